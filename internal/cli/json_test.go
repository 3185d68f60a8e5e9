package cli

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
)

// jsonFake answers every call the CLI's --json commands make: with zero
// records and empty lists, or (full) with every field set, lists of one.
type jsonFake struct {
	dsecv1connect.UnimplementedSandboxServiceHandler
	dsecv1connect.UnimplementedLayerServiceHandler
	dsecv1connect.UnimplementedFnCallServiceHandler
	full bool
}

// answer is a T, every field set when f.full.
func answer[T any, PT interface {
	*T
	proto.Message
}](f *jsonFake) (*connect.Response[T], error) {
	m := PT(new(T))
	if f.full {
		fill(m.ProtoReflect(), 0)
	}
	return connect.NewResponse((*T)(m)), nil
}

// fill sets every field of m: numbers to values past 2^32 where they are
// 64-bit, strings, lists of one, maps of one, nested messages (to depth 3),
// the first field of each oneof.
func fill(m protoreflect.Message, depth int) {
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if o := fd.ContainingOneof(); o != nil && !o.IsSynthetic() && o.Fields().Get(0) != fd {
			continue
		}
		switch {
		case fd.IsList():
			if v, ok := value(m, fd, depth); ok {
				m.Mutable(fd).List().Append(v)
			}
		case fd.IsMap():
			if v, ok := value(m, fd.MapValue(), depth); ok {
				m.Mutable(fd).Map().Set(protoreflect.ValueOfString("key").MapKey(), v)
			}
		case fd.Message() != nil:
			if depth < 3 {
				fill(m.Mutable(fd).Message(), depth+1)
			}
		default:
			v, _ := value(m, fd, depth)
			m.Set(fd, v)
		}
	}
}

func value(m protoreflect.Message, fd protoreflect.FieldDescriptor, depth int) (protoreflect.Value, bool) {
	switch fd.Kind() {
	case protoreflect.MessageKind:
		if depth >= 3 {
			return protoreflect.Value{}, false
		}
		var sub protoreflect.Message
		if fd.IsMap() || fd.ContainingMessage().IsMapEntry() {
			sub = m.NewField(fd.ContainingMessage().Fields().ByName("value")).Message()
		} else if fd.IsList() {
			sub = m.NewField(fd).List().NewElement().Message()
		} else {
			sub = m.NewField(fd).Message()
		}
		fill(sub, depth+1)
		return protoreflect.ValueOfMessage(sub), true
	case protoreflect.StringKind:
		return protoreflect.ValueOfString("text"), true
	case protoreflect.BytesKind:
		return protoreflect.ValueOfBytes([]byte("data")), true
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(true), true
	case protoreflect.EnumKind:
		return protoreflect.ValueOfEnum(1), true
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return protoreflect.ValueOfInt64(1_733_000_000_123), true
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return protoreflect.ValueOfUint64(1_733_000_000_123), true
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return protoreflect.ValueOfInt32(7), true
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return protoreflect.ValueOfUint32(7), true
	case protoreflect.DoubleKind:
		return protoreflect.ValueOfFloat64(1.5), true
	case protoreflect.FloatKind:
		return protoreflect.ValueOfFloat32(1.5), true
	}
	return protoreflect.Value{}, false
}

type (
	req[T any] = *connect.Request[T]
	res[T any] = *connect.Response[T]
)

func (f *jsonFake) Create(context.Context, req[dsecv1.CreateRequest]) (res[dsecv1.CreateResponse], error) {
	return answer[dsecv1.CreateResponse](f)
}
func (f *jsonFake) List(context.Context, req[dsecv1.ListRequest]) (res[dsecv1.ListResponse], error) {
	return answer[dsecv1.ListResponse](f)
}
func (f *jsonFake) GetServerInfo(context.Context, req[dsecv1.GetServerInfoRequest]) (res[dsecv1.ServerInfo], error) {
	return answer[dsecv1.ServerInfo](f)
}
func (f *jsonFake) Get(context.Context, req[dsecv1.GetRequest]) (res[dsecv1.Sandbox], error) {
	return answer[dsecv1.Sandbox](f)
}
func (f *jsonFake) Delete(context.Context, req[dsecv1.DeleteRequest]) (res[dsecv1.DeleteResponse], error) {
	return answer[dsecv1.DeleteResponse](f)
}
func (f *jsonFake) Pause(context.Context, req[dsecv1.PauseRequest]) (res[dsecv1.PauseResponse], error) {
	return answer[dsecv1.PauseResponse](f)
}
func (f *jsonFake) Resume(context.Context, req[dsecv1.ResumeRequest]) (res[dsecv1.ResumeResponse], error) {
	return answer[dsecv1.ResumeResponse](f)
}
func (f *jsonFake) SetTimeout(context.Context, req[dsecv1.SetTimeoutRequest]) (res[dsecv1.SetTimeoutResponse], error) {
	return answer[dsecv1.SetTimeoutResponse](f)
}
func (f *jsonFake) Metrics(context.Context, req[dsecv1.MetricsRequest]) (res[dsecv1.SandboxMetrics], error) {
	return answer[dsecv1.SandboxMetrics](f)
}
func (f *jsonFake) Snapshot(context.Context, req[dsecv1.SnapshotRequest]) (res[dsecv1.SnapshotInfo], error) {
	return answer[dsecv1.SnapshotInfo](f)
}
func (f *jsonFake) ListSnapshots(context.Context, req[dsecv1.ListSnapshotsRequest]) (res[dsecv1.ListSnapshotsResponse], error) {
	return answer[dsecv1.ListSnapshotsResponse](f)
}
func (f *jsonFake) DeleteSnapshot(context.Context, req[dsecv1.DeleteSnapshotRequest]) (res[dsecv1.DeleteSnapshotResponse], error) {
	return answer[dsecv1.DeleteSnapshotResponse](f)
}
func (f *jsonFake) Grade(context.Context, req[dsecv1.GradeRequest]) (res[dsecv1.GradeResult], error) {
	return answer[dsecv1.GradeResult](f)
}

func (f *jsonFake) Fork(context.Context, req[dsecv1.ForkRequest]) (res[dsecv1.ForkResponse], error) {
	r, err := answer[dsecv1.ForkResponse](f)
	for _, c := range r.Msg.GetChildren() {
		c.Error = "" // a child that failed makes fork exit 1
	}
	return r, err
}
func (f *jsonFake) ListProcesses(context.Context, req[dsecv1.ListProcessesRequest]) (res[dsecv1.ListProcessesResponse], error) {
	return answer[dsecv1.ListProcessesResponse](f)
}
func (f *jsonFake) SetNetworkRules(context.Context, req[dsecv1.SetNetworkRulesRequest]) (res[dsecv1.SetNetworkRulesResponse], error) {
	return answer[dsecv1.SetNetworkRulesResponse](f)
}
func (f *jsonFake) ListEvents(context.Context, req[dsecv1.ListEventsRequest]) (res[dsecv1.ListEventsResponse], error) {
	return answer[dsecv1.ListEventsResponse](f)
}
func (f *jsonFake) Usage(context.Context, req[dsecv1.UsageRequest]) (res[dsecv1.UsageResponse], error) {
	return answer[dsecv1.UsageResponse](f)
}

func (f *jsonFake) AddWebhook(context.Context, req[dsecv1.AddWebhookRequest]) (res[dsecv1.Webhook], error) {
	return answer[dsecv1.Webhook](f)
}

func (f *jsonFake) ListWebhooks(context.Context, req[dsecv1.ListWebhooksRequest]) (res[dsecv1.ListWebhooksResponse], error) {
	return answer[dsecv1.ListWebhooksResponse](f)
}

func (f *jsonFake) RotateWebhookSecret(context.Context, req[dsecv1.RotateWebhookSecretRequest]) (res[dsecv1.Webhook], error) {
	return answer[dsecv1.Webhook](f)
}

func (f *jsonFake) UpdateWebhook(context.Context, req[dsecv1.UpdateWebhookRequest]) (res[dsecv1.Webhook], error) {
	return answer[dsecv1.Webhook](f)
}

func (f *jsonFake) RemoveWebhook(context.Context, req[dsecv1.RemoveWebhookRequest]) (res[dsecv1.RemoveWebhookResponse], error) {
	return answer[dsecv1.RemoveWebhookResponse](f)
}

func (f *jsonFake) NetworkLog(context.Context, req[dsecv1.NetworkLogRequest]) (res[dsecv1.NetworkLogResponse], error) {
	return answer[dsecv1.NetworkLogResponse](f)
}

func (f *jsonFake) Provenance(context.Context, req[dsecv1.ProvenanceRequest]) (res[dsecv1.SandboxProvenance], error) {
	return answer[dsecv1.SandboxProvenance](f)
}

func (f *jsonFake) SetProvenancePaths(context.Context, req[dsecv1.SetProvenancePathsRequest]) (res[dsecv1.SetProvenancePathsResponse], error) {
	return answer[dsecv1.SetProvenancePathsResponse](f)
}
func (f *jsonFake) SetWarmPool(context.Context, req[dsecv1.SetWarmPoolRequest]) (res[dsecv1.WarmPool], error) {
	return answer[dsecv1.WarmPool](f)
}
func (f *jsonFake) ListWarmPools(context.Context, req[dsecv1.ListWarmPoolsRequest]) (res[dsecv1.ListWarmPoolsResponse], error) {
	return answer[dsecv1.ListWarmPoolsResponse](f)
}
func (f *jsonFake) Upload(context.Context, req[dsecv1.UploadRequest]) (res[dsecv1.UploadResponse], error) {
	return answer[dsecv1.UploadResponse](f)
}
func (f *jsonFake) Stat(context.Context, req[dsecv1.StatRequest]) (res[dsecv1.StatResponse], error) {
	return connect.NewResponse(&dsecv1.StatResponse{Info: &dsecv1.FileInfo{Type: "dir"}}), nil
}
func (f *jsonFake) Exec(_ context.Context, _ req[dsecv1.ExecRequest], s *connect.ServerStream[dsecv1.ExecEvent]) error {
	st := &dsecv1.ExecStarted{}
	if f.full {
		fill(st.ProtoReflect(), 0)
	}
	return s.Send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Started{Started: st}})
}
func (f *jsonFake) ImportLayer(context.Context, req[dsecv1.ImportLayerRequest]) (res[dsecv1.Layer], error) {
	r, err := answer[dsecv1.Layer](f)
	r.Msg.Warnings = nil // printed to stderr
	return r, err
}
func (f *jsonFake) ListLayers(context.Context, req[dsecv1.ListLayersRequest]) (res[dsecv1.ListLayersResponse], error) {
	return answer[dsecv1.ListLayersResponse](f)
}
func (f *jsonFake) LayerStats(context.Context, req[dsecv1.LayerStatsRequest]) (res[dsecv1.LayerStatsResponse], error) {
	return answer[dsecv1.LayerStatsResponse](f)
}
func (f *jsonFake) ListEnvironments(context.Context, req[dsecv1.ListEnvironmentsRequest]) (res[dsecv1.ListEnvironmentsResponse], error) {
	return answer[dsecv1.ListEnvironmentsResponse](f)
}
func (f *jsonFake) ImportImage(_ context.Context, _ req[dsecv1.ImportImageRequest], s *connect.ServerStream[dsecv1.ImportImageProgress]) error {
	p := &dsecv1.ImportImageProgress{}
	if f.full {
		fill(p.ProtoReflect(), 0)
	}
	p.Done = true
	return s.Send(p)
}
func (f *jsonFake) RunCode(context.Context, req[dsecv1.RunCodeRequest]) (res[dsecv1.RunCodeResponse], error) {
	return answer[dsecv1.RunCodeResponse](f)
}
func (f *jsonFake) ListLanguages(context.Context, req[dsecv1.ListLanguagesRequest]) (res[dsecv1.ListLanguagesResponse], error) {
	return answer[dsecv1.ListLanguagesResponse](f)
}

// documentedJSON reads docs/cli.md's JSON table: per command, the message
// it prints ("Sandbox") or the keys of the object it prints.
func documentedJSON(t *testing.T) map[string]string {
	t.Helper()
	doc, err := os.ReadFile("../../docs/cli.md")
	if err != nil {
		t.Fatal(err)
	}
	_, table, ok := strings.Cut(string(doc), "| command | `--json` prints |")
	if !ok {
		t.Fatal("docs/cli.md has no JSON table")
	}
	out := map[string]string{}
	row := regexp.MustCompile("^\\| `([a-z0-9 -]+)`[^|]* \\| (`([^`]+)`)?")
	for _, line := range strings.Split(table, "\n")[2:] {
		if !strings.HasPrefix(line, "|") {
			break
		}
		m := row.FindStringSubmatch(line)
		if m == nil {
			t.Fatalf("docs/cli.md JSON table: row %q is not | `command` | `shape` |", line)
		}
		out[m[1]] = m[3]
	}
	return out
}

// TestJSONShapes: every command's --json prints what docs/cli.md says, in
// one shape whether the answer is empty or full: the documented keys, each
// record with every field (camelCase, [] for an empty list), 64-bit
// integers as numbers.
func TestJSONShapes(t *testing.T) {
	f := &jsonFake{}
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(f))
	mux.Handle(dsecv1connect.NewLayerServiceHandler(f))
	mux.Handle(dsecv1connect.NewFnCallServiceHandler(f))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	dir := t.TempDir()
	os.WriteFile(dir+"/f", []byte("x"), 0o644)

	docs := documentedJSON(t)
	for _, tc := range []struct {
		command string   // as the doc's table names it
		args    []string // after the command
		msg     proto.Message
	}{
		{"create", []string{"b:1"}, &dsecv1.CreateResponse{}},
		{"ls", nil, &dsecv1.ListResponse{}},
		{"inspect", []string{"sb-n1-a"}, &dsecv1.Sandbox{}},
		{"nodes", nil, &dsecv1.ServerInfo{}},
		{"rm", []string{"sb-n1-a"}, nil},
		{"exec -d", []string{"sb-n1-a", "--", "true"}, &dsecv1.ExecStarted{}},
		{"ps", []string{"sb-n1-a"}, &dsecv1.ListProcessesResponse{}},
		{"pause", []string{"sb-n1-a", "sb-n1-b"}, &dsecv1.PauseResponse{}},
		{"resume", []string{"sb-n1-a"}, &dsecv1.ResumeResponse{}},
		{"timeout", []string{"sb-n1-a", "10m"}, &dsecv1.Sandbox{}},
		{"top", []string{"sb-n1-a"}, &dsecv1.SandboxMetrics{}},
		{"metrics", []string{"sb-n1-a"}, &dsecv1.SandboxMetrics{}},
		{"snapshot", []string{"sb-n1-a", "s1"}, &dsecv1.SnapshotInfo{}},
		{"snapshot ls", nil, &dsecv1.ListSnapshotsResponse{}},
		{"snapshot rm", []string{"s1"}, &dsecv1.DeleteSnapshotResponse{}},
		{"fork", []string{"sb-n1-a"}, &dsecv1.ForkResponse{}},
		{"grade", []string{"sb-n1-a", "--path", "/work", "-c", "true"}, &dsecv1.GradeResult{}},
		{"layer import", []string{"x:1", dir}, &dsecv1.Layer{}},
		{"layer ls", nil, &dsecv1.ListLayersResponse{}},
		{"layer stats", nil, &dsecv1.LayerStatsResponse{}},
		{"env ls", nil, &dsecv1.ListEnvironmentsResponse{}},
		{"image import", []string{"x:1", "oci:" + dir}, &dsecv1.ImportImageProgress{}},
		{"image ls", nil, nil},
		{"net set", []string{"sb-n1-a", "{}"}, &dsecv1.SetNetworkRulesResponse{}},
		{"net log", []string{"sb-n1-a"}, &dsecv1.NetworkLogResponse{}},
		{"events", nil, &dsecv1.ListEventsResponse{}},
		{"usage", nil, &dsecv1.UsageResponse{}},
		{"webhook add", []string{"https://example.com/hook"}, &dsecv1.Webhook{}},
		{"webhook ls", nil, &dsecv1.ListWebhooksResponse{}},
		{"webhook rm", []string{"wh-1"}, &dsecv1.RemoveWebhookResponse{}},
		{"webhook rotate", []string{"wh-1"}, &dsecv1.Webhook{}},
		{"webhook set", []string{"wh-1", "--batch", "100"}, &dsecv1.Webhook{}},
		{"provenance", []string{"sb-n1-a"}, &dsecv1.SandboxProvenance{}},
		{"provenance mark", []string{"sb-n1-a", "--protected", "/hidden"}, &dsecv1.SetProvenancePathsResponse{}},
		{"pool set", []string{"b:1"}, &dsecv1.WarmPool{}},
		{"pool rm", []string{"b:1"}, &dsecv1.WarmPool{}},
		{"pool ls", nil, &dsecv1.ListWarmPoolsResponse{}},
		{"fn run", []string{"-l", "python", "-"}, &dsecv1.RunCodeResponse{}},
		{"fn languages", nil, &dsecv1.ListLanguagesResponse{}},
		{"cp", []string{dir + "/f", "sb-n1-a:/tmp/"}, &dsecv1.UploadResponse{}},
	} {
		doc, ok := docs[tc.command]
		if !ok {
			t.Errorf("docs/cli.md does not say what %s --json prints", tc.command)
			continue
		}
		delete(docs, tc.command)
		for _, full := range []bool{false, true} {
			f.full = full
			args := append([]string{"--json"}, strings.Fields(tc.command)...)
			args = append(args, tc.args...)
			out, _, err := runCLIErr(t, srv.URL, args...)
			var ec *exitCode
			if err != nil && !(errors.As(err, &ec) && tc.command == "fn run") {
				t.Errorf("dsec %s: %v", strings.Join(args, " "), err)
				continue
			}
			dec := json.NewDecoder(strings.NewReader(out))
			dec.UseNumber()
			n := 0
			for ; ; n++ {
				var v any
				if err := dec.Decode(&v); err == io.EOF {
					break
				} else if err != nil {
					t.Fatalf("dsec %s printed %q: %v", strings.Join(args, " "), out, err)
				}
				checkDocumented(t, tc.command, doc, v, tc.msg)
				if tc.msg != nil {
					checkShape(t, tc.command, v, tc.msg.ProtoReflect().Descriptor())
				} else {
					checkCamel(t, tc.command, v)
				}
			}
			want := 1
			if tc.command == "pause" {
				want = 2 // one per sandbox
			}
			if n != want {
				t.Errorf("dsec %s printed %d JSON values:\n%s", strings.Join(args, " "), n, out)
			}
		}
	}
	delete(docs, "e2b env") // its values are the E2B SDKs' variables, not a record
	delete(docs, "bench")   // a report of its own (docs/cli.md says so)
	for command := range docs {
		t.Errorf("docs/cli.md says what %s --json prints, and no test checks it", command)
	}
}

// checkDocumented checks v against the doc's shape: the keys of its object,
// or the message it is.
func checkDocumented(t *testing.T, command, doc string, v any, msg proto.Message) {
	t.Helper()
	if !strings.HasPrefix(doc, "{") {
		if msg == nil || string(msg.ProtoReflect().Descriptor().Name()) != doc {
			t.Errorf("%s: the doc says it prints %s, the test reads %T", command, doc, msg)
		}
		return
	}
	// The keys at the top of the object: depth 1.
	var want []string
	depth := 0
	for i, c := range doc {
		switch c {
		case '{', '[':
			depth++
		case '}', ']':
			depth--
		case '"':
			if m := regexp.MustCompile(`^"(\w+)":`).FindStringSubmatch(doc[i:]); m != nil && depth == 1 && (i == 0 || doc[i-1] != '\\') {
				want = append(want, m[1])
			}
		}
	}
	obj, _ := v.(map[string]any)
	var got []string
	for k := range obj {
		got = append(got, k)
	}
	slices.Sort(want)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("%s --json has keys %v, docs/cli.md says %v", command, got, want)
	}
}

// checkShape checks that v is message md in the documented JSON form:
// camelCase keys of md's fields only; every field without presence there
// (scalars, lists, maps); 64-bit integers as numbers; nested records alike.
func checkShape(t *testing.T, path string, v any, md protoreflect.MessageDescriptor) {
	t.Helper()
	obj, ok := v.(map[string]any)
	if !ok {
		t.Errorf("%s: %v is not an object (a %s)", path, v, md.Name())
		return
	}
	fields := md.Fields()
	for k := range obj {
		if fields.ByJSONName(k) == nil {
			t.Errorf("%s: key %q is not a field of %s in JSON form", path, k, md.Name())
		}
	}
	for i := range fields.Len() {
		fd := fields.Get(i)
		val, present := obj[fd.JSONName()]
		if !present {
			if !fd.HasPresence() {
				t.Errorf("%s: %s.%s is missing", path, md.Name(), fd.JSONName())
			}
			continue
		}
		p := path + "." + fd.JSONName()
		switch {
		case fd.IsList():
			l, ok := val.([]any)
			if !ok {
				t.Errorf("%s: %v is not a list", p, val)
			}
			for _, e := range l {
				checkValue(t, p+"[]", e, fd)
			}
		case fd.IsMap():
			m, ok := val.(map[string]any)
			if !ok {
				t.Errorf("%s: %v is not an object", p, val)
			}
			for k, e := range m {
				checkValue(t, p+"["+k+"]", e, fd.MapValue())
			}
		default:
			checkValue(t, p, val, fd)
		}
	}
}

func checkValue(t *testing.T, path string, v any, fd protoreflect.FieldDescriptor) {
	t.Helper()
	switch fd.Kind() {
	case protoreflect.MessageKind:
		checkShape(t, path, v, fd.Message())
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind,
		protoreflect.Uint64Kind, protoreflect.Fixed64Kind,
		protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind,
		protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		n, ok := v.(json.Number)
		if _, err := strconv.ParseInt(string(n), 10, 64); !ok || err != nil {
			t.Errorf("%s: %#v is not an integer number", path, v)
		}
	case protoreflect.DoubleKind, protoreflect.FloatKind:
		if _, ok := v.(json.Number); !ok {
			t.Errorf("%s: %#v is not a number", path, v)
		}
	case protoreflect.BoolKind:
		if _, ok := v.(bool); !ok {
			t.Errorf("%s: %#v is not a boolean", path, v)
		}
	default: // strings, bytes, enums
		if _, ok := v.(string); !ok {
			t.Errorf("%s: %#v is not a string", path, v)
		}
	}
}

// checkCamel checks a shape the CLI makes itself: camelCase keys.
func checkCamel(t *testing.T, path string, v any) {
	t.Helper()
	switch v := v.(type) {
	case map[string]any:
		for k, e := range v {
			if strings.ContainsAny(k, "_-") {
				t.Errorf("%s: key %q is not camelCase", path, k)
			}
			checkCamel(t, path+"."+k, e)
		}
	case []any:
		for _, e := range v {
			checkCamel(t, path+"[]", e)
		}
	}
}
