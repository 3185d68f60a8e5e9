package store

import (
	"encoding/json"
	"math/rand/v2"
	"testing"
)

// TestLabelsJSON checks that appendLabelsJSON writes what json.Marshal
// does, which the rows of a key stored by the two ways must agree on:
// plain labels, those json.Marshal escapes, and random bytes.
func TestLabelsJSON(t *testing.T) {
	cases := []map[string]string{
		nil,
		{},
		{"dsec.dev/project": "ml/team"},
		{"run": "grpo-7", "dsec.dev/project": "ml/team", "step": "12", "a": ""},
		{"html": "<b>&</b>", "quote": `say "hi"`, "back\\slash": "tab\there", "nl": "a\nb\r\x00\x1f\x7f"},
		{"utf8": "héllo wörld", "bad": "\xff\xfe", "sep": "\u2028\u2029", "emoji": "🙂"},
	}
	// Each byte alone in a plain value and key.
	for c := range 256 {
		cases = append(cases, map[string]string{"k": "ab" + string(rune(c)) + "cd"}, map[string]string{string([]byte{byte(c)}): "v"})
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		m := map[string]string{}
		for range rng.IntN(4) {
			k, v := make([]byte, rng.IntN(6)), make([]byte, rng.IntN(10))
			for i := range k {
				k[i] = byte(rng.IntN(256))
			}
			for i := range v {
				v[i] = byte(rng.IntN(256))
			}
			m[string(k)] = string(v)
		}
		cases = append(cases, m)
	}
	for _, m := range cases {
		want, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if got := appendLabelsJSON([]byte("x"), m); string(got) != "x"+string(want) {
			t.Errorf("labels %q: got %s, json.Marshal writes %s", m, got[1:], want)
		}
	}
}
