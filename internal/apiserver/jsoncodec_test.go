package apiserver

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/pbjson"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
)

// TestNetworkRulesMustBeBooleans: over Connect's JSON, as the Python SDK and
// curl speak it, a rule's value is true or false and nothing else; anything
// else is refused with InvalidArgument naming the rule, and nothing is made.
func TestNetworkRulesMustBeBooleans(t *testing.T) {
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	edge := newFakeEdge("n1")
	hs := httptest.NewServer(New(Config{}, st, watcher.NewFixed(nodesOf(edge)...), slog.New(slog.DiscardHandler)).Handler())
	defer hs.Close()

	post := func(method, body string) (int, map[string]any) {
		t.Helper()
		for _, ct := range []string{"application/json", "application/json; charset=utf-8"} {
			resp, err := http.Post(hs.URL+"/dsec.v1.SandboxService/"+method, ct, strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			var out map[string]any
			if err := json.Unmarshal(b, &out); err != nil {
				t.Fatalf("%s %s: %v: %s", method, body, err, b)
			}
			if ct == "application/json; charset=utf-8" {
				return resp.StatusCode, out
			}
		}
		panic("unreachable")
	}

	for _, tc := range []struct {
		method, body, want string
	}{
		{"Create", `{"spec":{"environment":"b:1","networkRules":{"github":true,"pypi":"false"}}}`,
			`spec.networkRules["pypi"] is the string "false": want a JSON boolean, true or false`},
		{"Create", `{"spec":{"environment":"b:1","network_rules":{"pypi":1}}}`,
			`spec.network_rules["pypi"] is the number 1: want a JSON boolean`},
		{"Create", `{"spec":{"environment":"b:1","networkRules":{"pypi":null}}}`, `spec.networkRules["pypi"] is null`},
		{"SetWarmPool", `{"spec":{"environment":"b:1","networkRules":{"npm":"true"}},"size":1}`,
			`spec.networkRules["npm"] is the string "true"`},
		{"SetNetworkRules", `{"sandboxId":"sb-n1-x","rules":{"10.0.0.0/8":"no"}}`,
			`rules["10.0.0.0/8"] is the string "no"`},
		{"WriteStdin", `{"sandboxId":"sb-n1-x","processId":"p-1","close":"yes"}`, `close is the string "yes"`},
	} {
		code, out := post(tc.method, tc.body)
		if code != http.StatusBadRequest || out["code"] != "invalid_argument" {
			t.Errorf("%s %s: HTTP %d %v, want invalid_argument", tc.method, tc.body, code, out)
		}
		if msg, _ := out["message"].(string); !strings.Contains(msg, tc.want) {
			t.Errorf("%s %s: message %q, want it to contain %q", tc.method, tc.body, msg, tc.want)
		}
	}
	if n := edge.running(); n != 0 {
		t.Errorf("%d sandboxes were made from refused requests", n)
	}

	// Booleans pass, and mean what they say. A 64-bit integer is read as
	// a string or a number, and answered as a number.
	code, out := post("Create", `{"spec":{"environment":"b:1","memoryMb":"256","diskMb":512,"networkRules":{"pypi":false,"github":true}}}`)
	if code != http.StatusOK {
		t.Fatalf("create with boolean rules: HTTP %d %v", code, out)
	}
	sbs, _ := out["sandboxes"].([]any)
	for _, sb := range sbs {
		rules := sb.(map[string]any)["spec"].(map[string]any)["networkRules"].(map[string]any)
		if rules["pypi"] != false || rules["github"] != true {
			t.Errorf("rules stored as %v", rules)
		}
		spec := sb.(map[string]any)["spec"].(map[string]any)
		if spec["memoryMb"] != 256.0 || spec["diskMb"] != 512.0 {
			t.Errorf("memoryMb %#v and diskMb %#v: want the numbers 256 and 512", spec["memoryMb"], spec["diskMb"])
		}
	}
}

// TestJSONOfRelayedMessage: a message relayed from a remote edge undecoded
// (its fields held as raw wire bytes) is written as JSON with its fields.
func TestJSONOfRelayedMessage(t *testing.T) {
	ev := &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exited{Exited: &dsecv1.ExecExited{ExitCode: 3}}}
	wire, err := proto.Marshal(ev)
	if err != nil {
		t.Fatal(err)
	}
	relayed := &dsecv1.ExecEvent{}
	relayed.ProtoReflect().SetUnknown(wire)
	got, err := jsonCodec{name: "json"}.Marshal(relayed)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := pbjson.Marshal(ev, pbjson.Options{})
	if string(got) != string(want) {
		t.Fatalf("JSON of a relayed event: %s, want %s", got, want)
	}
}
