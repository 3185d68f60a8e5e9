package e2b

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// startDriver runs interp_driver.py on this machine's python3, as the
// adapter runs it in a sandbox, and returns its socket name.
func startDriver(t *testing.T) string {
	t.Helper()
	python, err := exec.LookPath("python3")
	if err != nil {
		if os.Getenv("DSEC_TEST_ROOT") == "1" {
			t.Fatal("DSEC_TEST_ROOT=1 but python3 is not installed")
		}
		t.Skip("python3 is not installed")
	}
	name := fmt.Sprintf("dsec-e2b-interp-test-%d-%d", os.Getpid(), time.Now().UnixNano())
	cmd := exec.Command(python, "-c", interpBoot, name, t.TempDir())
	cmd.Stdin = strings.NewReader(interpDriver)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if line != "ready\n" {
		t.Fatalf("driver's first line %q (%v), want ready; stderr: %s", line, err, stderr.String())
	}
	return name
}

// cell sends one request to the driver and returns its events, up to
// dsec_end.
func cell(t *testing.T, sock string, req map[string]any) []map[string]any {
	t.Helper()
	conn := dialDriver(t, sock, req)
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(20 * time.Second))
	var evs []map[string]any
	sc := bufio.NewScanner(conn)
	sc.Buffer(nil, 4<<20)
	for sc.Scan() {
		var ev map[string]any
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			t.Fatalf("driver line %q: %v", sc.Text(), err)
		}
		if ev["type"] == "dsec_end" {
			return evs
		}
		evs = append(evs, ev)
	}
	t.Fatalf("the driver closed the connection without dsec_end (%v) after %v", sc.Err(), evs)
	return nil
}

func dialDriver(t *testing.T, sock string, req map[string]any) net.Conn {
	t.Helper()
	conn, err := net.Dial("unix", "@"+sock)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := json.Marshal(req)
	head := make([]byte, 8)
	binary.BigEndian.PutUint64(head, uint64(len(body)))
	if _, err := conn.Write(append(head, body...)); err != nil {
		t.Fatal(err)
	}
	return conn
}

// summary is a cell's events in a compact form: "stdout:TEXT",
// "result:TEXT" (main results with a *), "error:NAME:VALUE".
func summary(evs []map[string]any) []string {
	var out []string
	for _, ev := range evs {
		switch ev["type"] {
		case "stdout", "stderr":
			out = append(out, fmt.Sprintf("%s:%s", ev["type"], ev["text"]))
		case "result":
			star := ""
			if ev["is_main_result"] == true {
				star = "*"
			}
			out = append(out, fmt.Sprintf("result%s:%v", star, ev["text"]))
		case "error":
			out = append(out, fmt.Sprintf("error:%s:%s", ev["name"], ev["value"]))
		}
	}
	return out
}

func TestInterpDriver(t *testing.T) {
	sock := startDriver(t)
	for _, tc := range []struct {
		name string
		req  map[string]any
		want []string
	}{
		{"print", map[string]any{"code": "print('hello')"}, []string{"stdout:hello\n"}},
		{"expression", map[string]any{"code": "x = 1\nx"}, []string{"result*:1"}},
		{"state", map[string]any{"code": "x += 1; x"}, []string{"result*:2"}},
		{"string result loses its quotes", map[string]any{"code": "'abc'"}, []string{"result*:abc"}},
		{"semicolon hides the value", map[string]any{"code": "x;"}, nil},
		{"stderr", map[string]any{"code": "import sys; print('e', file=sys.stderr)"}, []string{"stderr:e\n"}},
		{"error", map[string]any{"code": "1/0"}, []string{"error:ZeroDivisionError:division by zero"}},
		{"syntax error", map[string]any{"code": "def f(:"}, []string{"error:SyntaxError:invalid syntax (<cell-8>, line 1)"}},
		{"child output", map[string]any{"code": "import os; _ = os.system('echo child')"}, []string{"stdout:child\n"}},
		{"shell line", map[string]any{"code": "!echo bang"}, []string{"stdout:bang\n"}},
		{"env vars", map[string]any{"code": "import os; os.environ['DSEC_T']", "env_vars": map[string]string{"DSEC_T": "v"}}, []string{"result*:v"}},
		{"env vars are restored", map[string]any{"code": "os.environ.get('DSEC_T', 'unset')"}, []string{"result*:unset"}},
		{"top-level await", map[string]any{"code": "import asyncio\nawait asyncio.sleep(0)\n7"}, []string{"result*:7"}},
		{"display", map[string]any{"code": "class H:\n  def _repr_html_(self): return '<b>h</b>'\n  def __repr__(self): return 'H'\ndisplay(H())\nH()"},
			[]string{"result:H", "result*:H"}},
		{"input finds no stdin", map[string]any{"code": "input()"}, []string{"error:EOFError:EOF when reading a line"}},
		{"system exit is an error", map[string]any{"code": "import sys; sys.exit(3)"}, []string{"error:SystemExit:3"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := summary(cell(t, sock, tc.req))
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}

	t.Run("display data", func(t *testing.T) {
		evs := cell(t, sock, map[string]any{"code": "class P:\n  def _repr_png_(self): return b'\\x89PNG'\n  def _repr_html_(self): return '<i>p</i>'\nP()"})
		r := evs[len(evs)-1]
		if r["png"] != "iVBORw==" || r["html"] != "<i>p</i>" || r["is_main_result"] != true {
			t.Errorf("result %v, want png iVBORw== and html <i>p</i>", r)
		}
	})

	t.Run("execution count", func(t *testing.T) {
		a := cell(t, sock, map[string]any{"code": "1"})
		b := cell(t, sock, map[string]any{"code": "1"})
		ca, cb := a[0]["execution_count"].(float64), b[0]["execution_count"].(float64)
		if a[0]["type"] != "number_of_executions" || cb != ca+1 {
			t.Errorf("execution counts %v then %v, want consecutive", a[0], b[0])
		}
	})

	t.Run("traceback names the cell's line only", func(t *testing.T) {
		evs := cell(t, sock, map[string]any{"code": "def f():\n    raise ValueError('bad')\nf()"})
		tb, _ := evs[len(evs)-1]["traceback"].(string)
		if !strings.Contains(tb, "raise ValueError('bad')") || strings.Contains(tb, "dsec-e2b-driver") {
			t.Errorf("traceback:\n%s", tb)
		}
	})

	t.Run("timeout interrupts", func(t *testing.T) {
		start := time.Now()
		evs := cell(t, sock, map[string]any{"code": "import time\nprint('before', flush=True)\ntime.sleep(30)", "timeout": 0.5})
		if took := time.Since(start); took > 10*time.Second {
			t.Errorf("took %s", took)
		}
		got := summary(evs)
		if len(got) != 2 || got[0] != "stdout:before\n" || !strings.HasPrefix(got[1], "error:TimeoutError:") {
			t.Errorf("got %q", got)
		}
		if got := summary(cell(t, sock, map[string]any{"code": "x"})); fmt.Sprint(got) != "[result*:2]" {
			t.Errorf("after the timeout: %q, want the state kept", got)
		}
	})

	t.Run("output is capped", func(t *testing.T) {
		evs := cell(t, sock, map[string]any{"code": "for _ in range(60): print('x' * (1 << 20))\n'after'"})
		got := summary(evs)
		n := 0
		for _, ev := range evs {
			if ev["type"] == "stdout" {
				n += len(ev["text"].(string))
			}
		}
		last := got[len(got)-2:]
		if n > 48<<20 || n < 40<<20 || !strings.Contains(last[0], "output over 48 MiB") || last[1] != "result*:after" {
			t.Errorf("%d bytes of stdout, then %q", n, last)
		}
	})

	t.Run("a closed connection interrupts", func(t *testing.T) {
		conn := dialDriver(t, sock, map[string]any{"code": "import time\ntime.sleep(60)"})
		time.Sleep(300 * time.Millisecond)
		conn.Close()
		start := time.Now()
		if got := summary(cell(t, sock, map[string]any{"code": "1 + 1"})); fmt.Sprint(got) != "[result*:2]" {
			t.Errorf("got %q", got)
		}
		if took := time.Since(start); took > 5*time.Second {
			t.Errorf("the next cell waited %s for the abandoned one", took)
		}
	})
}
