package testutil

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
)

// VerlClient calls /run_code the way verl's sandbox_fusion reward code
// does (written here from its documented behaviour, not copied): the same
// payload, an HTTP timeout of compile+run+10 s, only 504 retried, 3 tries.
type VerlClient struct {
	URL   string
	Tries atomic.Int32
}

// Score is verl's per-case result: true/false as 1/0, or its negative
// error codes.
func (c *VerlClient) Score(code, stdin, expected, language string, compileTimeout, runTimeout float64) int {
	payload, _ := json.Marshal(map[string]any{
		"compile_timeout": compileTimeout, "run_timeout": runTimeout, "code": code, "stdin": stdin,
		"memory_limit_MB": 1024, "language": language, "files": map[string]any{}, "fetch_files": []string{},
	})
	client := &http.Client{Timeout: time.Duration((compileTimeout + runTimeout + 10) * float64(time.Second))}
	var resp map[string]any
	ok := false
	for attempt := 0; attempt < 3; attempt++ {
		c.Tries.Add(1)
		r, err := client.Post(c.URL, "application/json", bytes.NewReader(payload))
		if err != nil {
			return -1
		}
		if r.StatusCode == http.StatusGatewayTimeout {
			r.Body.Close()
			continue
		}
		if r.StatusCode/100 != 2 {
			r.Body.Close()
			return -1
		}
		err = json.NewDecoder(r.Body).Decode(&resp)
		r.Body.Close()
		if err != nil {
			return -1
		}
		ok = true
		break
	}
	if !ok {
		return -1
	}
	result := func(key string) (status string, rc any, stdout string, present bool) {
		m, isMap := resp[key].(map[string]any)
		if !isMap {
			return "", nil, "", false
		}
		s, _ := m["stdout"].(string)
		st, _ := m["status"].(string)
		return st, m["return_code"], s, true
	}
	nonZero := func(rc any) bool { n, isNum := rc.(float64); return isNum && n != 0 }
	switch resp["status"] {
	case "SandboxError":
		return -1
	case "Success":
		if st, _, out, ok := result("run_result"); ok && st == "Finished" {
			if strings.TrimRight(out, "\n") == strings.TrimRight(expected, "\n") {
				return 1
			}
			return 0
		}
		return -1
	}
	if st, rc, _, ok := result("compile_result"); ok && (st == "Error" || st == "TimeLimitExceeded" || nonZero(rc)) {
		return -4
	}
	if st, rc, _, ok := result("run_result"); ok {
		switch {
		case st == "TimeLimitExceeded":
			return -3
		case st == "Error" || nonZero(rc):
			return -2
		}
	}
	return -1
}
