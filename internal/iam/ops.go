package iam

// Op names an API operation: a Connect procedure ("/dsec.v1.SandboxService/Create"),
// or one of the management operations below, the RPCs of dsec.v1's
// IAMService (api/dsec/v1/iam.proto).
type Op string

// Management operations (projects, principals, bindings, tokens, quotas,
// audit).
const (
	OpCreateProject   Op = "/dsec.v1.IAMService/CreateProject"
	OpGetProject      Op = "/dsec.v1.IAMService/GetProject"
	OpListProjects    Op = "/dsec.v1.IAMService/ListProjects"
	OpDeleteProject   Op = "/dsec.v1.IAMService/DeleteProject"
	OpGetQuota        Op = "/dsec.v1.IAMService/GetQuota"
	OpSetQuota        Op = "/dsec.v1.IAMService/SetQuota"
	OpCreatePrincipal Op = "/dsec.v1.IAMService/CreatePrincipal"
	OpListPrincipals  Op = "/dsec.v1.IAMService/ListPrincipals"
	OpDeletePrincipal Op = "/dsec.v1.IAMService/DeletePrincipal"
	OpGrant           Op = "/dsec.v1.IAMService/Grant"
	OpUngrant         Op = "/dsec.v1.IAMService/Ungrant"
	OpListBindings    Op = "/dsec.v1.IAMService/ListBindings"
	OpCreateToken     Op = "/dsec.v1.IAMService/CreateToken"
	OpRevokeToken     Op = "/dsec.v1.IAMService/RevokeToken"
	OpListTokens      Op = "/dsec.v1.IAMService/ListTokens"
	OpQueryAudit      Op = "/dsec.v1.IAMService/QueryAudit"
	OpExportAudit     Op = "/dsec.v1.IAMService/ExportAudit"
)

// needs is the role every operation needs on the project it touches. Every
// RPC of api/dsec/v1's services is here (a test checks it); reading data
// inside a sandbox (files, processes, network logs) is a runner's, since it
// can hold what a runner put there.
//
// The edge protocol (api/dsec/edge/v1's EdgeService, SignReceipt among it)
// is not here: no principal calls it. An edge accepts only apiservers,
// by their certificate from the cluster CA (docs/cluster.md), and an
// apiserver calls it for an RPC of this table the caller passed, as a
// grade's receipt is signed for a Grade its caller may run.
var needs = map[Op]Role{
	// SandboxService
	"/dsec.v1.SandboxService/Create":              Runner,
	"/dsec.v1.SandboxService/Get":                 Viewer,
	"/dsec.v1.SandboxService/List":                Viewer,
	"/dsec.v1.SandboxService/Delete":              Runner,
	"/dsec.v1.SandboxService/Pause":               Runner,
	"/dsec.v1.SandboxService/Resume":              Runner,
	"/dsec.v1.SandboxService/SetTimeout":          Runner,
	"/dsec.v1.SandboxService/EndPhase":            Runner,
	"/dsec.v1.SandboxService/Metrics":             Viewer,
	"/dsec.v1.SandboxService/Snapshot":            Builder,
	"/dsec.v1.SandboxService/ListSnapshots":       Viewer,
	"/dsec.v1.SandboxService/DeleteSnapshot":      Builder,
	"/dsec.v1.SandboxService/Fork":                Runner,
	"/dsec.v1.SandboxService/Grade":               Runner,
	"/dsec.v1.SandboxService/Exec":                Runner,
	"/dsec.v1.SandboxService/Attach":              Runner,
	"/dsec.v1.SandboxService/WriteStdin":          Runner,
	"/dsec.v1.SandboxService/Signal":              Runner,
	"/dsec.v1.SandboxService/ListProcesses":       Runner,
	"/dsec.v1.SandboxService/SessionRun":          Runner,
	"/dsec.v1.SandboxService/SessionInterrupt":    Runner,
	"/dsec.v1.SandboxService/SessionClose":        Runner,
	"/dsec.v1.SandboxService/Shell":               Runner,
	"/dsec.v1.SandboxService/ReadFile":            Runner,
	"/dsec.v1.SandboxService/WriteFile":           Runner,
	"/dsec.v1.SandboxService/ListDir":             Runner,
	"/dsec.v1.SandboxService/Stat":                Runner,
	"/dsec.v1.SandboxService/Remove":              Runner,
	"/dsec.v1.SandboxService/MakeDir":             Runner,
	"/dsec.v1.SandboxService/Move":                Runner,
	"/dsec.v1.SandboxService/WatchDir":            Runner,
	"/dsec.v1.SandboxService/Upload":              Runner,
	"/dsec.v1.SandboxService/Download":            Runner,
	"/dsec.v1.SandboxService/SetNetworkRules":     Runner,
	"/dsec.v1.SandboxService/NetworkLog":          Runner,
	"/dsec.v1.SandboxService/Provenance":          Runner,
	"/dsec.v1.SandboxService/SetProvenancePaths":  Runner,
	"/dsec.v1.SandboxService/Trajectory":          Runner,
	"/dsec.v1.SandboxService/SetWarmPool":         Builder,
	"/dsec.v1.SandboxService/ListWarmPools":       Viewer,
	"/dsec.v1.SandboxService/GetServerInfo":       Viewer,
	"/dsec.v1.SandboxService/ListEvents":          Viewer,
	"/dsec.v1.SandboxService/FollowEvents":        Viewer,
	"/dsec.v1.SandboxService/Usage":               Viewer,
	"/dsec.v1.SandboxService/AddWebhook":          Admin,
	"/dsec.v1.SandboxService/ListWebhooks":        Admin,
	"/dsec.v1.SandboxService/RemoveWebhook":       Admin,
	"/dsec.v1.SandboxService/RotateWebhookSecret": Admin,
	"/dsec.v1.SandboxService/UpdateWebhook":       Admin,

	// FnCallService
	"/dsec.v1.FnCallService/RunCode":       Runner,
	"/dsec.v1.FnCallService/RunCodeBatch":  Runner,
	"/dsec.v1.FnCallService/ListLanguages": Viewer,

	// LayerService
	"/dsec.v1.LayerService/ImportLayer":      Builder,
	"/dsec.v1.LayerService/UploadLayer":      Builder,
	"/dsec.v1.LayerService/ListLayers":       Viewer,
	"/dsec.v1.LayerService/RemoveLayer":      Builder,
	"/dsec.v1.LayerService/ListEnvironments": Viewer,
	"/dsec.v1.LayerService/ImportImage":      Builder,
	"/dsec.v1.LayerService/LayerStats":       Viewer,
	"/dsec.v1.LayerService/ShareLayer":       Builder,

	// Management. Granting, minting and setting quotas have further rules
	// (CheckGrant, CheckMint, CheckQuota) beyond the role.
	OpCreateProject:   Admin,
	OpGetProject:      Viewer,
	OpListProjects:    Viewer,
	OpDeleteProject:   Admin,
	OpGetQuota:        Viewer,
	OpSetQuota:        Admin,
	OpCreatePrincipal: Admin,
	OpListPrincipals:  Admin,
	OpDeletePrincipal: Admin,
	OpGrant:           Admin,
	OpUngrant:         Admin,
	OpListBindings:    Admin,
	OpCreateToken:     Admin,
	OpRevokeToken:     Admin,
	OpListTokens:      Admin,
	OpQueryAudit:      Admin,
	OpExportAudit:     Admin,
}

// Need is the role op needs on the project it touches; ok is false for an
// operation the table does not name.
func Need(op Op) (role Role, ok bool) {
	role, ok = needs[op]
	return role, ok
}

// Ops lists every operation in the table.
func Ops() []Op {
	out := make([]Op, 0, len(needs))
	for op := range needs {
		out = append(out, op)
	}
	return out
}
