package pbjson

import (
	"encoding/json"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// TestNumbers: 64-bit integers come out as JSON numbers, at every depth
// (a nested message, a list of messages), everything else as protojson
// writes it, and the result still reads back as the same message.
func TestNumbers(t *testing.T) {
	msgs := []proto.Message{
		&dsecv1.ListResponse{Sandboxes: []*dsecv1.Sandbox{{
			Id: "sb-n1-a", CreatedUnixMs: 1_733_000_000_123, State: dsecv1.State_STATE_RUNNING,
			Spec: &dsecv1.SandboxSpec{Environment: "b:1", MemoryMb: 512, Cpus: 0.5, TtlSeconds: 3600,
				Env: map[string]string{"A": "<&>", "B": "é\n\"q\""}, NetworkRules: map[string]bool{"pypi": true}},
			LastPause: &dsecv1.PauseStats{ResidentBytes: 9_007_199_254_740_000},
			Warnings:  []string{"x < y & z"},
		}}},
		&dsecv1.LayerStatsResponse{Mode: "ondemand", Layers: []*dsecv1.LayerUsage{{Digest: "sha256:ab", Size: 1 << 40, ChunksFetched: 3}}},
		&dsecv1.RunCodeResponse{Files: map[string][]byte{"a.txt": []byte("hi")}},
	}
	for _, m := range msgs {
		for _, o := range []Options{{}, {EmitDefaults: true}} {
			b, err := Marshal(m, o)
			if err != nil {
				t.Fatal(err)
			}
			if strings.Contains(string(b), `":"1`) || strings.Contains(string(b), `":"9`) || strings.Contains(string(b), `":"5`) {
				t.Errorf("a quoted number in %s", b)
			}
			back := m.ProtoReflect().New().Interface()
			if err := protojson.Unmarshal(b, back); err != nil || !proto.Equal(back, m) {
				t.Errorf("%s reads back as %v (%v)", b, back, err)
			}
		}
	}
	b, _ := Marshal(msgs[0], Options{})
	var doc struct {
		Sandboxes []struct {
			CreatedUnixMs any
			Spec          struct {
				MemoryMb any
				Env      map[string]string
			}
			LastPause struct{ ResidentBytes any }
		}
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	sb := doc.Sandboxes[0]
	if sb.CreatedUnixMs != 1_733_000_000_123.0 || sb.Spec.MemoryMb != 512.0 || sb.LastPause.ResidentBytes != 9_007_199_254_740_000.0 {
		t.Errorf("numbers: %s", b)
	}
	if sb.Spec.Env["A"] != "<&>" || !strings.Contains(string(b), `"<&>"`) {
		t.Errorf("strings: %s", b)
	}
}

// TestEmitDefaults: with EmitDefaults an empty list is [] and a zero
// number 0, so a record has one shape; without, they are left out.
func TestEmitDefaults(t *testing.T) {
	for _, tc := range []struct {
		o    Options
		want string
	}{
		{Options{EmitDefaults: true}, `{"sandboxes":[],"nextPageToken":"","total":0,"unreachableNodes":[]}`},
		{Options{}, `{}`},
	} {
		b, err := Marshal(&dsecv1.ListResponse{}, tc.o)
		if err != nil || string(b) != tc.want {
			t.Errorf("%+v: %s (%v), want %s", tc.o, b, err, tc.want)
		}
	}
	b, _ := Marshal(&dsecv1.WarmPool{Key: "k"}, Options{EmitDefaults: true})
	var pool map[string]any
	json.Unmarshal(b, &pool)
	if pool["ready"] != 0.0 || pool["starting"] != 0.0 || pool["lastError"] != "" {
		t.Errorf("pool %s", b)
	}
}
