package apiserver

import (
	"testing"
	"time"
)

// TestUsagePullDue: a node's ledger is due when this apiserver never
// pulled it (or the store has none of it), always without a least time
// between pulls, and with one once that time has passed since the last
// stored pull.
func TestUsagePullDue(t *testing.T) {
	var u usageState
	u.init()
	if !u.due("n1", "e1", time.Hour) {
		t.Fatal("a node this apiserver never pulled is not due")
	}
	u.markPulled([]string{"n1"})
	if u.due("n1", "e1", time.Hour) {
		t.Error("a node pulled just now is due with an hour between pulls")
	}
	if !u.due("n1", "e1", 0) {
		t.Error("a node is not due with no least time between pulls")
	}
	u.mu.Lock()
	u.pulled["n1"] = time.Now().Add(-2 * time.Hour)
	u.mu.Unlock()
	if !u.due("n1", "e1", time.Hour) {
		t.Error("a node pulled two hours ago is not due with an hour between pulls")
	}
	u.markPulled([]string{"n2"})
	if !u.due("n2", "", time.Hour) {
		t.Error("a node whose ledger the store never had is not due")
	}
}
