// Package edgeclient is an apiserver's side of EdgeService for an edge on
// another machine: Remote implements the service's handler interface by
// calling the edge over Connect, so the apiserver calls a remote edge and
// the all-in-one dsecd's in-process one (package edgesvc) the same way.
// Errors come back as errdefs kinds (errors.Is works across the wire), and
// streams are relayed message by message, each as the edge framed it
// (passCodec), an exec's exit leaving with the end of the caller's stream.
package edgeclient

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/flushhold"
	"dsec.dev/dsec/internal/layerupload"
	"dsec.dev/dsec/internal/shellrelay"
)

// Remote is one edge reached over the network. It is safe for concurrent use.
type Remote struct {
	c    edgev1connect.EdgeServiceClient
	pass edgev1connect.EdgeServiceClient // c's twin whose streams pass through undecoded (passCodec)
	bidi edgev1connect.EdgeServiceClient // for the shell, which needs HTTP/2
}

var _ edgev1connect.EdgeServiceHandler = (*Remote)(nil)

// New returns the client of the edge serving at baseURL (https://HOST:PORT):
// hc carries every call but the shell's, uploads and Status, which take
// bidi (HTTP/2); both transports carry the cluster's TLS. One client may serve
// both when it speaks HTTP/2. Unary calls and server streams go best over HTTP/1.1 with
// kept-alive connections: a request leaves in one write, where HTTP/2 flushes
// its headers and its body apart (measured: a third of an apiserver's CPU in
// a create burst went to those writes).
//
// answered, if not nil, is called whenever the edge answers a call, with a
// result or an error of its own (not a transport's): the watcher counts it
// as a sign of life when its polls cannot get through.
func New(hc, bidi *http.Client, baseURL string, answered func()) *Remote {
	opts := []connect.ClientOption{connect.WithAcceptCompression("gzip", nil, nil)}
	if answered != nil {
		opts = append(opts, connect.WithInterceptors(answerInterceptor(answered)))
	}
	return &Remote{
		c:    edgev1connect.NewEdgeServiceClient(hc, baseURL, opts...),
		pass: edgev1connect.NewEdgeServiceClient(hc, baseURL, append(opts, connect.WithCodec(passCodec{}))...),
		bidi: edgev1connect.NewEdgeServiceClient(bidi, baseURL, opts...),
	}
}

// Dial returns the client of the edge serving at baseURL
// (https://HOST:PORT) over tc, the apiserver's side of the cluster's mutual
// TLS (clustertls.ClientConfig, naming the edge expected): HTTP/1.1 with
// kept-alive connections for every call but the shell's, uploads and
// Status, HTTP/2 for those (see New). answered is as New's.
func Dial(tc *tls.Config, baseURL string, answered func()) *Remote {
	return New(&http.Client{Transport: transport(tc, false)}, &http.Client{Transport: transport(tc, true)}, baseURL, answered)
}

func transport(tc *tls.Config, h2 bool) *http.Transport {
	tr := &http.Transport{
		TLSClientConfig:     tc.Clone(),
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
		TLSHandshakeTimeout: 5 * time.Second,
		Protocols:           new(http.Protocols),
		// No gzip between apiservers and edges: the client does not offer
		// it (New), and without this the transport offers it for them and
		// unpacks the answer itself, so the edge packed every answer past
		// 16 KiB (an events pull's, a list's) and the apiserver unpacked
		// it: 1–2 % of each one's CPU in bench cluster, for a link
		// inside a cluster.
		DisableCompression: true,
	}
	if h2 {
		tr.Protocols.SetHTTP2(true)
	} else {
		tr.Protocols.SetHTTP1(true)
	}
	return tr
}

// answerInterceptor calls its function when a unary call ends with the
// edge's answer, or a stream brings its first message.
type answerInterceptor func()

// edgeAnswered says whether err (nil: a result) came from the edge itself.
// The codes a failed transport yields do not count: a dead edge answers
// nothing.
func edgeAnswered(err error) bool {
	if err == nil {
		return true
	}
	switch connect.CodeOf(err) {
	case connect.CodeUnavailable, connect.CodeDeadlineExceeded, connect.CodeCanceled, connect.CodeUnknown:
		return false
	}
	return true
}

func (a answerInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		resp, err := next(ctx, req)
		if edgeAnswered(err) {
			a()
		}
		return resp, err
	}
}

func (a answerInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		return &answerConn{StreamingClientConn: next(ctx, spec), answered: a}
	}
}

func (a answerInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// answerConn is a client stream that reports its first message received.
type answerConn struct {
	connect.StreamingClientConn
	answered answerInterceptor
	once     bool
}

func (c *answerConn) Receive(msg any) error {
	err := c.StreamingClientConn.Receive(msg)
	if err == nil && !c.once {
		c.once = true
		c.answered()
	}
	return err
}

// execExited is the number of ExecEvent's exited field: the last event of
// an exec's stream.
const execExited protowire.Number = 4

func unary[Req, Res any](ctx context.Context, call func(context.Context, *connect.Request[Req]) (*connect.Response[Res], error), req *connect.Request[Req]) (*connect.Response[Res], error) {
	resp, err := call(ctx, connect.NewRequest(req.Msg))
	if err != nil {
		return nil, errdefs.FromConnect(err)
	}
	return connect.NewResponse(resp.Msg), nil
}

// relay hands a stream from the edge to the caller's, each message as the
// edge framed it (call is a method of the pass client). A message with the
// field numbered last ends the stream: it leaves with the stream's end.
func relay[Req, Res any, PRes interface {
	*Res
	proto.Message
}](ctx context.Context, call func(context.Context, *connect.Request[Req]) (*connect.ServerStreamForClient[Res], error), req *connect.Request[Req], out *connect.ServerStream[Res], last protowire.Number) error {
	in, err := call(ctx, connect.NewRequest(req.Msg))
	if err != nil {
		return errdefs.FromConnect(err)
	}
	defer in.Close()
	for in.Receive() {
		if last != 0 && hasField(PRes(in.Msg()), last) {
			flushhold.Hold(ctx)
		}
		if err := out.Send(in.Msg()); err != nil {
			return err
		}
	}
	return streamErr(ctx, in.Err())
}

// streamErr is the error of a relayed stream that ended with err: the
// edge's own answer as its kind; a stream the edge never ended (it died,
// the connection broke: connect's words for it are a protocol error
// such as "incomplete envelope", coded InvalidArgument or Unknown) as
// Unavailable, so a caller types it as the platform's fault, never as its
// own bad argument.
func streamErr(ctx context.Context, err error) error {
	var ce *connect.Error
	if err == nil || ctx.Err() != nil || !errors.As(err, &ce) || connect.IsWireError(ce) {
		return errdefs.FromConnect(err)
	}
	return fmt.Errorf("the edge's stream broke before its end: %v: %w", err, errdefs.ErrUnavailable)
}

// Status goes over the HTTP/2 client, whose one connection the watcher's
// polls keep warm: over the HTTP/1.1 pool, a poll during a burst that holds
// every kept-alive connection needed a new connection and its TLS handshake,
// which a starved 2-core node did not finish within the poll's timeout three
// times running (a 10,000-call FnCall storm made its node unroutable).
func (r *Remote) Status(ctx context.Context, req *connect.Request[edgev1.StatusRequest]) (*connect.Response[edgev1.NodeStatus], error) {
	return unary(ctx, r.bidi.Status, req)
}

func (r *Remote) Create(ctx context.Context, req *connect.Request[edgev1.CreateRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return unary(ctx, r.c.Create, req)
}

func (r *Remote) CreateMany(ctx context.Context, req *connect.Request[edgev1.CreateManyRequest]) (*connect.Response[edgev1.CreateManyResponse], error) {
	return unary(ctx, r.c.CreateMany, req)
}

func (r *Remote) Fork(ctx context.Context, req *connect.Request[edgev1.ForkRequest]) (*connect.Response[edgev1.ForkResponse], error) {
	return unary(ctx, r.c.Fork, req)
}

func (r *Remote) Get(ctx context.Context, req *connect.Request[dsecv1.GetRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return unary(ctx, r.c.Get, req)
}

func (r *Remote) List(ctx context.Context, req *connect.Request[edgev1.ListRequest]) (*connect.Response[edgev1.ListResponse], error) {
	return unary(ctx, r.c.List, req)
}

func (r *Remote) Delete(ctx context.Context, req *connect.Request[dsecv1.DeleteRequest]) (*connect.Response[dsecv1.DeleteResponse], error) {
	return unary(ctx, r.c.Delete, req)
}

func (r *Remote) Pause(ctx context.Context, req *connect.Request[dsecv1.PauseRequest]) (*connect.Response[dsecv1.PauseResponse], error) {
	return unary(ctx, r.c.Pause, req)
}

func (r *Remote) Resume(ctx context.Context, req *connect.Request[dsecv1.ResumeRequest]) (*connect.Response[dsecv1.ResumeResponse], error) {
	return unary(ctx, r.c.Resume, req)
}

func (r *Remote) EndPhase(ctx context.Context, req *connect.Request[dsecv1.EndPhaseRequest]) (*connect.Response[dsecv1.EndPhaseResponse], error) {
	return unary(ctx, r.c.EndPhase, req)
}

func (r *Remote) SetTimeout(ctx context.Context, req *connect.Request[dsecv1.SetTimeoutRequest]) (*connect.Response[dsecv1.SetTimeoutResponse], error) {
	return unary(ctx, r.c.SetTimeout, req)
}

func (r *Remote) Metrics(ctx context.Context, req *connect.Request[dsecv1.MetricsRequest]) (*connect.Response[dsecv1.SandboxMetrics], error) {
	return unary(ctx, r.c.Metrics, req)
}

func (r *Remote) Snapshot(ctx context.Context, req *connect.Request[dsecv1.SnapshotRequest]) (*connect.Response[dsecv1.SnapshotInfo], error) {
	return unary(ctx, r.c.Snapshot, req)
}

func (r *Remote) RunCode(ctx context.Context, req *connect.Request[dsecv1.RunCodeRequest]) (*connect.Response[dsecv1.RunCodeResponse], error) {
	return unary(ctx, r.c.RunCode, req)
}

func (r *Remote) ListLanguages(ctx context.Context, req *connect.Request[dsecv1.ListLanguagesRequest]) (*connect.Response[dsecv1.ListLanguagesResponse], error) {
	return unary(ctx, r.c.ListLanguages, req)
}

func (r *Remote) SetNetworkRules(ctx context.Context, req *connect.Request[dsecv1.SetNetworkRulesRequest]) (*connect.Response[dsecv1.SetNetworkRulesResponse], error) {
	return unary(ctx, r.c.SetNetworkRules, req)
}

func (r *Remote) NetworkLog(ctx context.Context, req *connect.Request[dsecv1.NetworkLogRequest]) (*connect.Response[dsecv1.NetworkLogResponse], error) {
	return unary(ctx, r.c.NetworkLog, req)
}

func (r *Remote) Provenance(ctx context.Context, req *connect.Request[dsecv1.ProvenanceRequest]) (*connect.Response[dsecv1.SandboxProvenance], error) {
	return unary(ctx, r.c.Provenance, req)
}

func (r *Remote) SetProvenancePaths(ctx context.Context, req *connect.Request[dsecv1.SetProvenancePathsRequest]) (*connect.Response[dsecv1.SetProvenancePathsResponse], error) {
	return unary(ctx, r.c.SetProvenancePaths, req)
}

func (r *Remote) SetWarmPool(ctx context.Context, req *connect.Request[dsecv1.SetWarmPoolRequest]) (*connect.Response[dsecv1.WarmPool], error) {
	return unary(ctx, r.c.SetWarmPool, req)
}

func (r *Remote) ListWarmPools(ctx context.Context, req *connect.Request[dsecv1.ListWarmPoolsRequest]) (*connect.Response[dsecv1.ListWarmPoolsResponse], error) {
	return unary(ctx, r.c.ListWarmPools, req)
}

func (r *Remote) Reap(ctx context.Context, req *connect.Request[edgev1.ReapRequest]) (*connect.Response[edgev1.ReapResponse], error) {
	return unary(ctx, r.c.Reap, req)
}

func (r *Remote) Gone(ctx context.Context, req *connect.Request[edgev1.GoneRequest]) (*connect.Response[edgev1.GoneResponse], error) {
	return unary(ctx, r.c.Gone, req)
}

func (r *Remote) SignReceipt(ctx context.Context, req *connect.Request[edgev1.SignReceiptRequest]) (*connect.Response[edgev1.SignReceiptResponse], error) {
	return unary(ctx, r.c.SignReceipt, req)
}

func (r *Remote) Attest(ctx context.Context, req *connect.Request[edgev1.AttestRequest]) (*connect.Response[edgev1.AttestResponse], error) {
	return unary(ctx, r.c.Attest, req)
}

func (r *Remote) Events(ctx context.Context, req *connect.Request[edgev1.EventsRequest]) (*connect.Response[edgev1.EventsResponse], error) {
	return unary(ctx, r.c.Events, req)
}

func (r *Remote) LiveUsage(ctx context.Context, req *connect.Request[edgev1.LiveUsageRequest]) (*connect.Response[edgev1.LiveUsageResponse], error) {
	return unary(ctx, r.c.LiveUsage, req)
}

func (r *Remote) ImportLayer(ctx context.Context, req *connect.Request[dsecv1.ImportLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	return unary(ctx, r.c.ImportLayer, req)
}

func (r *Remote) ListLayers(ctx context.Context, req *connect.Request[dsecv1.ListLayersRequest]) (*connect.Response[dsecv1.ListLayersResponse], error) {
	return unary(ctx, r.c.ListLayers, req)
}

func (r *Remote) RemoveLayer(ctx context.Context, req *connect.Request[dsecv1.RemoveLayerRequest]) (*connect.Response[dsecv1.RemoveLayerResponse], error) {
	return unary(ctx, r.c.RemoveLayer, req)
}

func (r *Remote) ListEnvironments(ctx context.Context, req *connect.Request[dsecv1.ListEnvironmentsRequest]) (*connect.Response[dsecv1.ListEnvironmentsResponse], error) {
	return unary(ctx, r.c.ListEnvironments, req)
}

func (r *Remote) ImportImage(ctx context.Context, req *connect.Request[dsecv1.ImportImageRequest], out *connect.ServerStream[dsecv1.ImportImageProgress]) error {
	return relay(ctx, r.c.ImportImage, req, out, 0)
}

// ImportImageTo is ImportImage with progress sent through send.
func (r *Remote) ImportImageTo(ctx context.Context, m *dsecv1.ImportImageRequest, send func(*dsecv1.ImportImageProgress) error) error {
	in, err := r.c.ImportImage(ctx, connect.NewRequest(m))
	if err != nil {
		return errdefs.FromConnect(err)
	}
	defer in.Close()
	for in.Receive() {
		if err := send(in.Msg()); err != nil {
			return err
		}
	}
	return errdefs.FromConnect(in.Err())
}

func (r *Remote) UploadLayer(ctx context.Context, stream *connect.ClientStream[dsecv1.UploadLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	l, err := r.UploadLayerFrom(ctx, stream)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(l), nil
}

// UploadLayerFrom relays an upload's stream to the edge message by
// message, over HTTP/2: an edge that refuses the upload before its end
// answers while the rest is unsent, which HTTP/1.1 can lose to the
// connection the edge closes under the body. A stream that breaks is
// abandoned (the call is cancelled), and it carries no end marker, so the
// edge never takes a truncated archive for a whole one.
func (r *Remote) UploadLayerFrom(ctx context.Context, in layerupload.Stream) (*dsecv1.Layer, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	up := r.bidi.UploadLayer(ctx)
	for in.Receive() {
		if err := up.Send(in.Msg()); err != nil {
			if errors.Is(err, io.EOF) {
				break // the edge ended the call: its answer says why
			}
			return nil, errdefs.FromConnect(err)
		}
	}
	if err := in.Err(); err != nil {
		cancel()
		up.CloseAndReceive()
		return nil, err
	}
	resp, err := up.CloseAndReceive()
	if err != nil {
		return nil, errdefs.FromConnect(err)
	}
	return resp.Msg, nil
}

func (r *Remote) AdoptLayers(ctx context.Context, req *connect.Request[edgev1.AdoptLayersRequest]) (*connect.Response[edgev1.AdoptLayersResponse], error) {
	return unary(ctx, r.c.AdoptLayers, req)
}

func (r *Remote) RenameRef(ctx context.Context, req *connect.Request[edgev1.RenameRefRequest]) (*connect.Response[edgev1.RenameRefResponse], error) {
	return unary(ctx, r.c.RenameRef, req)
}

func (r *Remote) LayerStats(ctx context.Context, req *connect.Request[dsecv1.LayerStatsRequest]) (*connect.Response[dsecv1.LayerStatsResponse], error) {
	return unary(ctx, r.c.LayerStats, req)
}

func (r *Remote) Exec(ctx context.Context, req *connect.Request[dsecv1.ExecRequest], out *connect.ServerStream[dsecv1.ExecEvent]) error {
	return relay(ctx, r.pass.Exec, req, out, execExited)
}

func (r *Remote) Attach(ctx context.Context, req *connect.Request[dsecv1.AttachRequest], out *connect.ServerStream[dsecv1.ExecEvent]) error {
	return relay(ctx, r.pass.Attach, req, out, execExited)
}

func (r *Remote) SessionRun(ctx context.Context, req *connect.Request[dsecv1.SessionRunRequest], out *connect.ServerStream[dsecv1.ExecEvent]) error {
	return relay(ctx, r.pass.SessionRun, req, out, execExited)
}

func (r *Remote) Download(ctx context.Context, req *connect.Request[dsecv1.DownloadRequest], out *connect.ServerStream[dsecv1.DownloadChunk]) error {
	return relay(ctx, r.pass.Download, req, out, 0)
}

func (r *Remote) WatchDir(ctx context.Context, req *connect.Request[dsecv1.WatchDirRequest], out *connect.ServerStream[dsecv1.WatchEvent]) error {
	return relay(ctx, r.pass.WatchDir, req, out, 0)
}

func (r *Remote) WriteStdin(ctx context.Context, req *connect.Request[dsecv1.WriteStdinRequest]) (*connect.Response[dsecv1.WriteStdinResponse], error) {
	return unary(ctx, r.c.WriteStdin, req)
}

func (r *Remote) Signal(ctx context.Context, req *connect.Request[dsecv1.SignalRequest]) (*connect.Response[dsecv1.SignalResponse], error) {
	return unary(ctx, r.c.Signal, req)
}

func (r *Remote) ListProcesses(ctx context.Context, req *connect.Request[dsecv1.ListProcessesRequest]) (*connect.Response[dsecv1.ListProcessesResponse], error) {
	return unary(ctx, r.c.ListProcesses, req)
}

func (r *Remote) SessionInterrupt(ctx context.Context, req *connect.Request[dsecv1.SessionInterruptRequest]) (*connect.Response[dsecv1.SessionInterruptResponse], error) {
	return unary(ctx, r.c.SessionInterrupt, req)
}

func (r *Remote) SessionClose(ctx context.Context, req *connect.Request[dsecv1.SessionCloseRequest]) (*connect.Response[dsecv1.SessionCloseResponse], error) {
	return unary(ctx, r.c.SessionClose, req)
}

func (r *Remote) ReadFile(ctx context.Context, req *connect.Request[dsecv1.ReadFileRequest]) (*connect.Response[dsecv1.ReadFileResponse], error) {
	return unary(ctx, r.c.ReadFile, req)
}

func (r *Remote) WriteFile(ctx context.Context, req *connect.Request[dsecv1.WriteFileRequest]) (*connect.Response[dsecv1.WriteFileResponse], error) {
	return unary(ctx, r.c.WriteFile, req)
}

func (r *Remote) ListDir(ctx context.Context, req *connect.Request[dsecv1.ListDirRequest]) (*connect.Response[dsecv1.ListDirResponse], error) {
	return unary(ctx, r.c.ListDir, req)
}

func (r *Remote) Stat(ctx context.Context, req *connect.Request[dsecv1.StatRequest]) (*connect.Response[dsecv1.StatResponse], error) {
	return unary(ctx, r.c.Stat, req)
}

func (r *Remote) Remove(ctx context.Context, req *connect.Request[dsecv1.RemoveRequest]) (*connect.Response[dsecv1.RemoveResponse], error) {
	return unary(ctx, r.c.Remove, req)
}

func (r *Remote) MakeDir(ctx context.Context, req *connect.Request[dsecv1.MakeDirRequest]) (*connect.Response[dsecv1.MakeDirResponse], error) {
	return unary(ctx, r.c.MakeDir, req)
}

func (r *Remote) Move(ctx context.Context, req *connect.Request[dsecv1.MoveRequest]) (*connect.Response[dsecv1.MoveResponse], error) {
	return unary(ctx, r.c.Move, req)
}

func (r *Remote) Upload(ctx context.Context, req *connect.Request[dsecv1.UploadRequest]) (*connect.Response[dsecv1.UploadResponse], error) {
	return unary(ctx, r.c.Upload, req)
}

// Shell relays a bidirectional PTY stream between the caller and the edge.
func (r *Remote) Shell(ctx context.Context, stream *connect.BidiStream[dsecv1.ShellInput, dsecv1.ShellOutput]) error {
	first, err := stream.Receive()
	if err != nil {
		return err
	}
	return r.ShellFrom(ctx, first, stream)
}

// ShellFrom is Shell for a caller that has read the first message already.
func (r *Remote) ShellFrom(ctx context.Context, first *dsecv1.ShellInput, stream shellrelay.Stream) error {
	return shellrelay.Relay(ctx, first, stream, r.bidi.Shell, errdefs.FromConnect)
}

func (r *Remote) Trajectory(ctx context.Context, req *connect.Request[dsecv1.TrajectoryRequest]) (*connect.Response[dsecv1.TrajectoryResponse], error) {
	return unary(ctx, r.c.Trajectory, req)
}
