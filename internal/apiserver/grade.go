package apiserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/grade"
	"dsec.dev/dsec/internal/memconn"
)

// Grade grades a sandbox in a clean room (package grade). It needs a
// runner's role on the sandbox's project (ops.go), as an exec does; the
// grade's own calls (the capture, the clean room's create, its files, the
// grader's exec, the deletes) then go through the server's own API over
// an in-process connection as the node's, since a runner may not take
// snapshots: the clean room carries the sandbox's project label, so it is
// that project's and charged to it, and the capture is deleted with it.
func (s *Server) Grade(ctx context.Context, req *connect.Request[dsecv1.GradeRequest]) (*connect.Response[dsecv1.GradeResult], error) {
	if err := grade.Check(req.Msg); err != nil {
		return nil, err
	}
	// The caller must see the sandbox: another project's is NotFound.
	if _, err := s.getSandbox(ctx, req.Msg.GetSandboxId()); err != nil {
		return nil, err
	}
	started := time.Now()
	// What the agent did is read beside the grade, not before it: the
	// trajectory hash is a prefix of the trajectory as it stood when
	// read (which may or may not hold the grade's capture step), and the
	// provenance flags are the sandbox's as the grade ran.
	type evidence struct {
		trajectory string
		prov       *dsecv1.SandboxProvenance
		took       time.Duration
	}
	ev := make(chan evidence, 1)
	go func() {
		t := time.Now()
		var e evidence
		e.trajectory, e.prov = s.gradeEvidence(ctx, req.Msg.GetSandboxId())
		e.took = time.Since(t)
		ev <- e
	}()
	var rooms grade.Rooms
	if s.cfg.GradePool > 0 {
		rooms = gradeRooms{s}
	}
	res, done, err := grade.Run(ctx, s.loop.client(s), req.Msg, rooms)
	e := <-ev
	if err != nil {
		return nil, err
	}
	res.TrajectoryHash, res.Provenance = e.trajectory, e.prov
	res.Times.EvidenceMs = e.took.Milliseconds()
	// The receipt is signed before the clean room goes: its edge still
	// holds it and what its grader did. A receipt that cannot be made is
	// logged and left out, never the grade failed for it.
	t := time.Now()
	if res.Receipt, err = s.gradeReceipt(ctx, req.Msg, res, started, time.Now()); err != nil {
		lvl := slog.LevelWarn
		if errors.Is(err, errdefs.ErrNotSupported) {
			lvl = slog.LevelInfo // a node that holds no receipt key
		}
		s.log.Log(ctx, lvl, "grade without a receipt", "sandbox", req.Msg.GetSandboxId(), "err", err)
	}
	res.Times.ReceiptMs = time.Since(t).Milliseconds()
	res.Times.TotalMs = time.Since(started).Milliseconds()
	// The clean room and the capture go after the reply: a trainer waits
	// for the reward, not for the deletes.
	go func() {
		for _, w := range done(context.WithoutCancel(ctx)) {
			s.log.Warn("grade left something behind", "sandbox", req.Msg.GetSandboxId(), "err", w)
		}
	}()
	return connect.NewResponse(res), nil
}

// gradeEvidence reads a graded sandbox's trajectory hash so far and its
// provenance (flags only) through the server's own API. Either that cannot
// be read (a node recording none, a backend without provenance) is left
// empty and logged: the grade goes on without it, and the receipt says so
// by its empty field.
func (s *Server) gradeEvidence(ctx context.Context, id string) (trajectory string, prov *dsecv1.SandboxProvenance) {
	api := s.loop.client(s)
	t, err := api.Trajectory(ctx, connect.NewRequest(&dsecv1.TrajectoryRequest{SandboxId: id, LimitBytes: 1}))
	switch {
	case err != nil:
		s.log.Info("grade without a trajectory hash", "sandbox", id, "err", err)
	case t.Msg.GetSha256() != "":
		trajectory = fmt.Sprintf("sha256:%s@%d", t.Msg.GetSha256(), t.Msg.GetSize())
	}
	p, err := api.Provenance(ctx, connect.NewRequest(&dsecv1.ProvenanceRequest{SandboxId: id, FlagsOnly: true}))
	if err != nil {
		s.log.Info("grade without provenance", "sandbox", id, "err", err)
		return trajectory, nil
	}
	return trajectory, p.Msg
}

// loopback is an in-process client of the server's own API (package
// memconn; the connection is in-process, so a call without a token is the
// node's own, as an adapter's). It is made on first use and lives as long
// as the process. The console (console.go) calls through it too, always
// with its signed-in token.
type loopback struct {
	once sync.Once
	hc   *http.Client
	c    dsecv1connect.SandboxServiceClient
}

func (l *loopback) client(s *Server) dsecv1connect.SandboxServiceClient {
	l.init(s)
	return l.c
}

// http is the loopback's HTTP client, for clients of the other services.
func (l *loopback) http(s *Server) *http.Client {
	l.init(s)
	return l.hc
}

func (l *loopback) init(s *Server) {
	l.once.Do(func() {
		mem := memconn.New()
		srv := &http.Server{Handler: s.Handler(), ConnContext: ConnContext, Protocols: new(http.Protocols)}
		srv.Protocols.SetUnencryptedHTTP2(true)
		go srv.Serve(mem) // ends with the process
		tr := &http.Transport{DialContext: mem.Dial, Protocols: new(http.Protocols), MaxIdleConnsPerHost: 64}
		tr.Protocols.SetUnencryptedHTTP2(true)
		l.hc = &http.Client{Transport: tr}
		l.c = dsecv1connect.NewSandboxServiceClient(l.hc, "http://in-process")
	})
}
