package sandboxfusion

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// /submit judges a completion against test cases, as SandboxFusion's
// CommonOJDataset does with cases the request brings
// (config.provided_data); dsec holds no datasets of its own.

// EvalResult is SandboxFusion's answer to /submit.
type EvalResult struct {
	ID            any            `json:"id"`
	Accepted      bool           `json:"accepted"`
	ExtractedCode string         `json:"extracted_code"`
	FullCode      *string        `json:"full_code"`
	TestCode      *string        `json:"test_code"`
	Tests         []EvalTestCase `json:"tests"`
	ExtractedType *string        `json:"extracted_type"`
	Extra         map[string]any `json:"extra"`
}

// EvalTestCase is one case's outcome.
type EvalTestCase struct {
	Passed   bool             `json:"passed"`
	ExecInfo *RunCodeResponse `json:"exec_info"`
	TestInfo map[string]any   `json:"test_info"`
}

// Judging, SandboxFusion's numbers.
const (
	caseParallelism = 3 // cases of one submission running at once
	caseAttempts    = 5 // tries of a case that meets a SandboxError
	truncateCase    = 1000
)

// caseBackoff is the wait before a case's second try; it doubles after.
const caseBackoff = 100 * time.Millisecond

// compiledLanguages get SandboxFusion's compile-language timeouts
// (run_timeout or 10 s); others get run_timeout or 20 s.
var compiledLanguages = map[string]bool{"cpp": true, "go": true, "java": true}

type stdioCase struct {
	input, output map[string]string
}

func (c stdioCase) info(full bool) map[string]any {
	in, out := map[string]any{}, map[string]any{}
	for k, v := range c.input {
		if !full {
			v = truncate(v)
		}
		in[k] = v
	}
	for k, v := range c.output {
		if !full {
			v = truncate(v)
		}
		out[k] = v
	}
	return map[string]any{"input": in, "output": out}
}

// truncate keeps both ends of a long string, as SandboxFusion's
// truncate_str (by characters).
func truncate(s string) string {
	r := []rune(s)
	if len(r) <= truncateCase {
		return s
	}
	keep := (truncateCase - 3) / 2
	return string(r[:keep]) + "..." + string(r[len(r)-keep:])
}

type submission struct {
	id         any
	completion string
	language   string
	compileTO  float64
	runTO      float64
	cases      []stdioCase
	runAll     bool
	fullCase   bool
}

// parseSubmit reads a SubmitRequest. Field errors go to c; a request that
// is well formed but cannot be judged here is answered 400 (err), as
// SandboxFusion answers a dataset it cannot judge.
func parseSubmit(c *checker, m map[string]any) (*submission, error) {
	loc := []any{"body"}
	s := &submission{}
	c.str(m, loc, "dataset", true, false)
	if v, ok := c.get(m, loc, "id", true); ok {
		switch v.(type) {
		case json.Number, string:
			s.id = v
		default:
			c.add(loc, "id", "int_type", "Input should be a valid integer or string")
		}
	} else if _, present := m["id"]; present {
		c.add(loc, "id", "int_type", "Input should be a valid integer or string")
	}
	s.completion, _ = c.str(m, loc, "completion", true, false)
	cfg, ok := c.object(m, loc, "config", true)
	if !ok {
		if v, present := m["config"]; present && v == nil {
			c.add(loc, "config", "model_type", "Input should be a valid dictionary or instance of TestConfig")
		}
		return s, nil
	}
	cloc := append(loc, "config")
	s.language, _ = c.str(cfg, cloc, "language", false, true)
	c.str(cfg, cloc, "locale", false, true)
	c.str(cfg, cloc, "dataset_type", false, true)
	s.compileTO = c.float(cfg, cloc, "compile_timeout", 0, true)
	s.runTO = c.float(cfg, cloc, "run_timeout", 0, true)
	custom, _ := c.str(cfg, cloc, "custom_extract_logic", false, true)
	extra, _ := c.object(cfg, cloc, "extra", false)
	if v, ok := extra["run_all_cases"]; ok {
		s.runAll, _ = c.boolean(v)
	}
	if v, ok := extra["return_full_case"]; ok {
		s.fullCase, _ = c.boolean(v)
	}
	pd, hasPD := cfg["provided_data"]
	if c.failed() {
		return s, nil
	}
	switch {
	case s.language == "":
		return s, fmt.Errorf("config.language field must exist for CommonOJDataset, got None")
	case custom != "":
		return s, fmt.Errorf("config.custom_extract_logic is not supported by dsec (it would run Python in the server); extract the code before submitting")
	case !hasPD || pd == nil:
		return s, fmt.Errorf("dsec holds no datasets: send the cases in config.provided_data, e.g. {\"test\": [{\"input\": {\"stdin\": \"1 2\"}, \"output\": {\"stdout\": \"3\"}}]}")
	}
	cases, err := parseCases(pd)
	if err != nil {
		return s, fmt.Errorf("config.provided_data: %w", err)
	}
	s.cases = cases
	return s, nil
}

// parseCases reads provided_data: {"test": cases} as SandboxFusion takes
// it, where cases is a list of {"input": {"stdin": ...}, "output":
// {"stdout": ...}} or that list as a JSON string; or the APPS/TACO shape
// verl's code data uses, {"inputs": [...], "outputs": [...]}, under
// "test" or "input_output".
func parseCases(pd any) ([]stdioCase, error) {
	d, ok := pd.(map[string]any)
	if !ok {
		return nil, fmt.Errorf("should be a dict with the cases under \"test\"")
	}
	raw, ok := d["test"]
	if !ok {
		raw, ok = d["input_output"]
	}
	if !ok {
		return nil, fmt.Errorf("has no \"test\" (or \"input_output\") holding the cases")
	}
	if s, isStr := raw.(string); isStr {
		dec := json.NewDecoder(stringReader(s))
		dec.UseNumber()
		if err := dec.Decode(&raw); err != nil {
			return nil, fmt.Errorf("test: a string that is not JSON: %v", err)
		}
	}
	var cases []stdioCase
	switch t := raw.(type) {
	case []any:
		for i, e := range t {
			em, ok := e.(map[string]any)
			if !ok {
				return nil, fmt.Errorf("test[%d]: should be {\"input\": {...}, \"output\": {...}}", i)
			}
			in, err := strDict(em["input"])
			if err != nil {
				return nil, fmt.Errorf("test[%d].input: %w", i, err)
			}
			out, err := strDict(em["output"])
			if err != nil {
				return nil, fmt.Errorf("test[%d].output: %w", i, err)
			}
			if _, ok := out["stdout"]; !ok {
				return nil, fmt.Errorf("test[%d].output: has no \"stdout\"", i)
			}
			cases = append(cases, stdioCase{in, out})
		}
	case map[string]any:
		if fn, ok := t["fn_name"]; ok && fn != nil && fn != "" {
			return nil, fmt.Errorf("fn_name cases are not supported; send stdin/stdout cases")
		}
		ins, iok := t["inputs"].([]any)
		outs, ook := t["outputs"].([]any)
		if !iok || !ook || len(ins) != len(outs) {
			return nil, fmt.Errorf("test: should hold \"inputs\" and \"outputs\", lists of strings of the same length")
		}
		for i := range ins {
			in, iok := ins[i].(string)
			out, ook := outs[i].(string)
			if !iok || !ook {
				return nil, fmt.Errorf("test: inputs[%d] and outputs[%d] should be strings", i, i)
			}
			cases = append(cases, stdioCase{map[string]string{"stdin": in}, map[string]string{"stdout": out}})
		}
	default:
		return nil, fmt.Errorf("test: should be a list of cases")
	}
	if len(cases) == 0 {
		return nil, fmt.Errorf("test: holds no cases")
	}
	return cases, nil
}

func strDict(v any) (map[string]string, error) {
	m, ok := v.(map[string]any)
	if !ok {
		return nil, fmt.Errorf("should be a dict of strings")
	}
	out := make(map[string]string, len(m))
	for k, e := range m {
		s, ok := e.(string)
		if !ok {
			return nil, fmt.Errorf("%q should be a string", k)
		}
		out[k] = s
	}
	return out, nil
}

func (h *handler) submit(w http.ResponseWriter, req *http.Request) {
	m, ok := h.readBody(w, req)
	if !ok {
		return
	}
	var c checker
	s, err := parseSubmit(&c, m)
	if c.failed() {
		h.reject(w, &c)
		return
	}
	if err != nil {
		writeJSON(w, http.StatusBadRequest, detail("%s", err.Error()))
		return
	}
	code, kind := extractCode(s.completion, s.language)
	base := &dsecv1.RunCodeRequest{Language: s.language, Code: code, CompileTimeoutSeconds: 10, RunTimeoutSeconds: 20}
	if s.compileTO > 0 {
		base.CompileTimeoutSeconds = s.compileTO
	}
	if compiledLanguages[s.language] {
		base.RunTimeoutSeconds = 10
	}
	if s.runTO > 0 {
		base.RunTimeoutSeconds = s.runTO
	}

	tests, err := h.judge(req.Context(), s, base)
	if err != nil {
		h.callFailed(w, req.Context(), err)
		return
	}
	accepted := true
	for _, t := range tests {
		accepted = accepted && t.Passed
	}
	writeJSON(w, http.StatusOK, &EvalResult{
		ID: s.id, Accepted: accepted, ExtractedCode: code, FullCode: &code,
		Tests: tests, ExtractedType: &kind,
	})
}

type caseOutcome struct {
	resp *RunCodeResponse
	err  error
}

// judge runs the cases caseParallelism at a time and answers them in
// order up to the first failure (all of them with run_all_cases); the
// cases after a failure are cancelled. An error is the first case's that
// could not be judged at all (a bad request, or still overloaded after
// every try).
func (h *handler) judge(ctx context.Context, s *submission, base *dsecv1.RunCodeRequest) ([]EvalTestCase, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sem := make(chan struct{}, caseParallelism)
	outcomes := make([]chan caseOutcome, len(s.cases))
	for i, tc := range s.cases {
		outcomes[i] = make(chan caseOutcome, 1)
		go func() {
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				outcomes[i] <- caseOutcome{err: ctx.Err()}
				return
			}
			defer func() { <-sem }()
			rc := &dsecv1.RunCodeRequest{
				Language: base.Language, Code: base.Code, Stdin: []byte(tc.input["stdin"]),
				CompileTimeoutSeconds: base.CompileTimeoutSeconds, RunTimeoutSeconds: base.RunTimeoutSeconds,
			}
			resp, err := h.runCase(ctx, rc)
			outcomes[i] <- caseOutcome{resp, err}
		}()
	}
	var tests []EvalTestCase
	for i, tc := range s.cases {
		o := <-outcomes[i]
		if o.err != nil {
			return nil, o.err
		}
		passed := o.resp.Status == statusSuccess && o.resp.RunResult != nil &&
			outputMatches(o.resp.RunResult.Stdout, tc.output["stdout"])
		// SandboxFusion shortens the case it reports only when it passed.
		tests = append(tests, EvalTestCase{Passed: passed, ExecInfo: o.resp, TestInfo: tc.info(s.fullCase || !passed)})
		if !passed && !s.runAll {
			break
		}
	}
	return tests, nil
}

// runCase runs one case, trying again (after a growing, jittered wait)
// when it meets a SandboxError or the cluster is full, caseAttempts times
// in all. After the last try a SandboxError is the case's result; an
// overload is the error.
func (h *handler) runCase(ctx context.Context, rc *dsecv1.RunCodeRequest) (*RunCodeResponse, error) {
	var last *RunCodeResponse
	var lastErr error
	for attempt := range caseAttempts {
		if attempt > 0 {
			d := caseBackoff << (attempt - 1)
			d = d/2 + rand.N(d)
			select {
			case <-time.After(d):
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		resp, err := h.call(ctx, rc)
		if err == nil {
			if resp.Status != statusSandboxError {
				return resp, nil
			}
			last, lastErr = resp, nil
			continue
		}
		switch classify(ctx, err) {
		case kindGone, kindInvalid:
			return nil, err
		case kindOverloaded:
			last, lastErr = nil, err
		default:
			h.log.Warn("sandboxfusion: run a case", "attempt", attempt+1, "err", err)
			last, lastErr = sandboxError(err.Error()), nil
		}
	}
	if last != nil {
		return last, nil
	}
	return nil, lastErr
}
