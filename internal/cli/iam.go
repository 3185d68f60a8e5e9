package cli

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// The IAM commands: projects, quotas, principals, role bindings, tokens and
// the audit trail (docs/iam.md). Each acts with the CLI's token; the server
// refuses what the token does not hold.

// displayPath shows a project path, the root as "/".
func displayPath(p string) string {
	if p == "" {
		return "/"
	}
	return p
}

// optional is s for an optional request field: unset when "".
func optional(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// parseDays reads a duration as time.ParseDuration does, also taking whole
// days ("30d").
func parseDays(s string) (time.Duration, error) {
	if n, ok := strings.CutSuffix(s, "d"); ok {
		d, err := strconv.Atoi(n)
		if err != nil || d < 0 {
			return 0, fmt.Errorf("duration %q: want a number of days (30d) or a Go duration (90m, 1h30m)", s)
		}
		return time.Duration(d) * 24 * time.Hour, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("duration %q: want a number of days (30d) or a Go duration (90m, 1h30m)", s)
	}
	return d, nil
}

func msTime(ms int64) string {
	if ms == 0 {
		return "-"
	}
	return time.UnixMilli(ms).UTC().Format(time.RFC3339)
}

func (a *app) projectCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "project",
		Short: "make, list and delete projects, and set their quotas",
	}
	cmd.AddCommand(a.projectCreateCommand(), a.projectLsCommand(), a.projectRmCommand(), a.projectQuotaCommand())
	return cmd
}

func (a *app) projectCreateCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "create PATH",
		Short: "make a project under its existing parent (ml/rl-run-42); needs admin on the parent",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			res, err := a.c.IAM.CreateProject(cmd.Context(), connect.NewRequest(&dsecv1.CreateProjectRequest{Path: args[0]}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			fmt.Fprintln(a.stdout, displayPath(res.Msg.GetPath()))
			return nil
		},
	}
}

func (a *app) projectLsCommand() *cobra.Command {
	var all bool
	cmd := &cobra.Command{
		Use:   "ls [PATH]",
		Short: "list a project's children (default: the token's project), or with --all every project under it",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &dsecv1.ListProjectsRequest{Subtree: all}
			if len(args) == 1 {
				req.Path = &args[0]
			}
			res, err := a.c.IAM.ListProjects(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "PROJECT\tCREATED")
			for _, p := range res.Msg.GetProjects() {
				fmt.Fprintf(tw, "%s\t%s\n", displayPath(p.GetPath()), msTime(p.GetCreatedUnixMs()))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVarP(&all, "all", "a", false, "every project under it, not only its children")
	return cmd
}

func (a *app) projectRmCommand() *cobra.Command {
	var toParent bool
	cmd := &cobra.Command{
		Use: "rm PATH",
		Short: "delete an empty project with its role bindings and tokens (one in use, its layers, images and snapshots " +
			"included, is refused, saying what uses it)",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			_, err := a.c.IAM.DeleteProject(cmd.Context(), connect.NewRequest(&dsecv1.DeleteProjectRequest{Path: args[0], ObjectsToParent: toParent}))
			return err
		},
	}
	cmd.Flags().BoolVar(&toParent, "objects-to-parent", false, "hand its layers, images and snapshots (names, shares, bytes charged) to its parent instead of refusing")
	return cmd
}

func (a *app) projectQuotaCommand() *cobra.Command {
	return &cobra.Command{
		Use: "quota PATH [RESOURCE=LIMIT...]",
		Short: "set a project's limits (sandboxes, vcpus in milli-CPUs, memory_mb, disk_mb, snapshot_bytes, layer_bytes, " +
			"fncall_inflight, creates_per_second; LIMIT \"none\" removes its own), carved from its nearest limited ancestor's; " +
			"without limits, show its use against them as dsec quota does",
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 1 {
				return a.showQuota(cmd, args[0])
			}
			type item struct {
				res string
				lim int64
			}
			var items []item
			for _, kv := range args[1:] {
				k, v, ok := strings.Cut(kv, "=")
				if !ok || k == "" {
					return fmt.Errorf("limit %q: want RESOURCE=LIMIT (sandboxes=64, memory_mb=none)", kv)
				}
				lim := int64(-1)
				if v != "none" {
					n, err := strconv.ParseInt(v, 10, 64)
					if err != nil || n < 0 {
						return fmt.Errorf("limit %q: want a number of 0 or more, or none", kv)
					}
					lim = n
				}
				items = append(items, item{k, lim})
			}
			for _, it := range items {
				if _, err := a.c.IAM.SetQuota(cmd.Context(), connect.NewRequest(&dsecv1.SetQuotaRequest{Project: args[0], Resource: it.res, Limit: it.lim})); err != nil {
					return err
				}
			}
			return nil
		},
	}
}

func (a *app) quotaCommand() *cobra.Command {
	var project string
	cmd := &cobra.Command{
		Use:   "quota",
		Short: "show the use against the limits of a project (default: the token's) and of its children",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.showQuota(cmd, project)
		},
	}
	cmd.Flags().StringVarP(&project, "project", "p", "", "the project (default: the token's project)")
	return cmd
}

// showQuota prints the quota of project ("" the token's) and its children.
func (a *app) showQuota(cmd *cobra.Command, project string) error {
	res, err := a.c.IAM.GetQuota(cmd.Context(), connect.NewRequest(&dsecv1.GetQuotaRequest{Project: optional(project)}))
	if err != nil {
		return err
	}
	if a.json {
		return a.printProto(res.Msg)
	}
	return printQuota(a.stdout, res.Msg.GetProjects())
}

// printQuota prints one row a project, one column a resource: USED/LIMIT,
// USED alone where the project has no limit of its own.
func printQuota(w io.Writer, ps []*dsecv1.ProjectQuota) error {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	if len(ps) == 0 {
		return nil
	}
	head := []string{"PROJECT"}
	for _, it := range ps[0].GetItems() {
		head = append(head, strings.ToUpper(it.GetResource()))
	}
	fmt.Fprintln(tw, strings.Join(head, "\t"))
	for _, p := range ps {
		row := []string{displayPath(p.GetProject())}
		for _, it := range p.GetItems() {
			cell := strconv.FormatInt(it.GetUsed(), 10)
			if it.GetResource() == "creates_per_second" {
				cell = "-" // a rate: nothing held
			}
			if it.GetLimit() >= 0 {
				cell += "/" + strconv.FormatInt(it.GetLimit(), 10)
			}
			row = append(row, cell)
		}
		fmt.Fprintln(tw, strings.Join(row, "\t"))
	}
	return tw.Flush()
}

func (a *app) principalCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "principal",
		Short: "make, list and delete principals (people and service accounts) and list their roles",
	}
	cmd.AddCommand(a.principalCreateCommand(), a.principalLsCommand(), a.principalRmCommand(), a.principalRolesCommand())
	return cmd
}

func (a *app) principalCreateCommand() *cobra.Command {
	var kind, project string
	cmd := &cobra.Command{
		Use:   "create NAME",
		Short: "make a principal at home in a project, whose admins manage it",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			res, err := a.c.IAM.CreatePrincipal(cmd.Context(), connect.NewRequest(&dsecv1.CreatePrincipalRequest{Name: args[0], Kind: kind, Project: project}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			fmt.Fprintln(a.stdout, res.Msg.GetName())
			return nil
		},
	}
	cmd.Flags().StringVar(&kind, "kind", "user", "user (a person) or service (a harness, an agent, a builder)")
	cmd.Flags().StringVarP(&project, "project", "p", "", "its home project (default: the token's project)")
	return cmd
}

func (a *app) principalLsCommand() *cobra.Command {
	var project string
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "list the principals at home in a project (default: the token's) or under it",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			res, err := a.c.IAM.ListPrincipals(cmd.Context(), connect.NewRequest(&dsecv1.ListPrincipalsRequest{Project: optional(project)}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tKIND\tPROJECT\tCREATED")
			for _, p := range res.Msg.GetPrincipals() {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", p.GetName(), p.GetKind(), displayPath(p.GetProject()), msTime(p.GetCreatedUnixMs()))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringVarP(&project, "project", "p", "", "the project (default: the token's project)")
	return cmd
}

func (a *app) principalRmCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "rm NAME",
		Short: "delete a principal, its role bindings, its tokens and the tokens minted from them",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			_, err := a.c.IAM.DeletePrincipal(cmd.Context(), connect.NewRequest(&dsecv1.DeletePrincipalRequest{Name: args[0]}))
			return err
		},
	}
}

func (a *app) principalRolesCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "roles [NAME]",
		Short: "list a principal's role bindings (default: the token's principal)",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &dsecv1.ListBindingsRequest{}
			if len(args) == 1 {
				req.Principal = args[0]
			}
			res, err := a.c.IAM.ListBindings(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "PRINCIPAL\tPROJECT\tROLE")
			for _, b := range res.Msg.GetBindings() {
				fmt.Fprintf(tw, "%s\t%s\t%s\n", b.GetPrincipal(), displayPath(b.GetProject()), b.GetRole())
			}
			return tw.Flush()
		},
	}
}

func (a *app) grantCommand() *cobra.Command {
	var project string
	cmd := &cobra.Command{
		Use:   "grant PRINCIPAL ROLE",
		Short: "give a principal a role (viewer, runner, builder, admin) on a project and everything under it; needs admin there and at least the role",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			_, err := a.c.IAM.Grant(cmd.Context(), connect.NewRequest(&dsecv1.GrantRequest{Principal: args[0], Role: args[1], Project: project}))
			return err
		},
	}
	cmd.Flags().StringVarP(&project, "project", "p", "", "the project (required; / for the root)")
	_ = cmd.MarkFlagRequired("project")
	return cmd
}

func (a *app) revokeCommand() *cobra.Command {
	var project string
	cmd := &cobra.Command{
		Use:   "revoke PRINCIPAL",
		Short: "remove a principal's role binding on a project (dsec token revoke revokes a token)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			_, err := a.c.IAM.Ungrant(cmd.Context(), connect.NewRequest(&dsecv1.UngrantRequest{Principal: args[0], Project: project}))
			return err
		},
	}
	cmd.Flags().StringVarP(&project, "project", "p", "", "the project (required; / for the root)")
	_ = cmd.MarkFlagRequired("project")
	return cmd
}

func (a *app) tokenCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "token",
		Short: "mint, list and revoke API tokens",
	}
	cmd.AddCommand(a.tokenCreateCommand(), a.tokenLsCommand(), a.tokenRevokeCommand())
	return cmd
}

func (a *app) tokenCreateCommand() *cobra.Command {
	var principal, project, role, ttl string
	cmd := &cobra.Command{
		Use: "create",
		Short: "mint a token, no more than this one holds (a project in its subtree, a role at most its own, a life no longer); " +
			"prints the token, which is shown once",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &dsecv1.CreateTokenRequest{Principal: principal, Project: project, Role: role}
			if ttl != "" {
				d, err := parseDays(ttl)
				if err != nil {
					return fmt.Errorf("--ttl: %w", err)
				}
				req.TtlSeconds = int64((d + time.Second - 1) / time.Second)
			}
			res, err := a.c.IAM.CreateToken(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			info := res.Msg.GetInfo()
			fmt.Fprintf(a.stderr, "token %s for %s: %s on %s, expires %s\n", info.GetId(), info.GetPrincipal(), info.GetRole(),
				displayPath(info.GetProject()), msTime(info.GetExpiresUnixMs()))
			fmt.Fprintln(a.stdout, res.Msg.GetToken())
			return nil
		},
	}
	cmd.Flags().StringVar(&principal, "principal", "", "the principal it is for (default: this token's)")
	cmd.Flags().StringVarP(&project, "project", "p", "", "its project (default: this token's)")
	cmd.Flags().StringVar(&role, "role", "", "viewer, runner, builder or admin (default: this token's)")
	cmd.Flags().StringVar(&ttl, "ttl", "", "its lifetime, e.g. 1h or 30d, no longer than this token's (default: no expiry, which only a token without expiry may mint)")
	return cmd
}

func (a *app) tokenLsCommand() *cobra.Command {
	var principal string
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "list a principal's tokens (default: this token's principal), without their secrets",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			res, err := a.c.IAM.ListTokens(cmd.Context(), connect.NewRequest(&dsecv1.ListTokensRequest{Principal: principal}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tPRINCIPAL\tPROJECT\tROLE\tPARENT\tCREATED\tEXPIRES\tREVOKED")
			for _, t := range res.Msg.GetTokens() {
				parent := t.GetParent()
				if parent == "" {
					parent = "-"
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", t.GetId(), t.GetPrincipal(), displayPath(t.GetProject()), t.GetRole(),
					parent, msTime(t.GetCreatedUnixMs()), msTime(t.GetExpiresUnixMs()), msTime(t.GetRevokedUnixMs()))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringVar(&principal, "principal", "", "the principal (default: this token's)")
	return cmd
}

func (a *app) tokenRevokeCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "revoke ID",
		Short: "revoke a token and every token minted from it",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			res, err := a.c.IAM.RevokeToken(cmd.Context(), connect.NewRequest(&dsecv1.RevokeTokenRequest{Id: args[0]}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			fmt.Fprintf(a.stdout, "revoked %d token(s)\n", res.Msg.GetRevoked())
			return nil
		},
	}
}

func (a *app) auditCommand() *cobra.Command {
	var project, since, until, principal string
	var limit int32
	cmd := &cobra.Command{
		Use:   "audit",
		Short: "show the audit trail of management calls on a project (default: the token's) and under it; --json exports it all as JSON lines",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &dsecv1.QueryAuditRequest{Project: optional(project), Principal: principal, Limit: limit}
			now := time.Now()
			for _, f := range []struct {
				name, v string
				ms      *int64
			}{{"--since", since, &req.SinceUnixMs}, {"--until", until, &req.UntilUnixMs}} {
				if f.v == "" {
					continue
				}
				t, err := pointInTime(f.v, now)
				if err != nil {
					return fmt.Errorf("%s: %w", f.name, err)
				}
				*f.ms = t.UnixMilli()
			}
			if a.json {
				return a.exportAudit(cmd, req)
			}
			res, err := a.c.IAM.QueryAudit(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return err
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "TIME\tPRINCIPAL\tPROJECT\tOPERATION\tOBJECT\tRESULT\tPEER\tMESSAGE")
			for _, r := range res.Msg.GetRecords() {
				op := r.GetOperation()
				if i := strings.LastIndexByte(op, '/'); i >= 0 {
					op = op[i+1:]
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", msTime(r.GetAtUnixMs()), r.GetPrincipal(), displayPath(r.GetProject()),
					op, r.GetObject(), r.GetCode(), r.GetPeer(), r.GetMessage())
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringVarP(&project, "project", "p", "", "the project, with everything under it (default: the token's project)")
	cmd.Flags().StringVar(&since, "since", "", "from this time: a duration ago (1h, 7d) or RFC 3339")
	cmd.Flags().StringVar(&until, "until", "", "before this time: a duration ago or RFC 3339")
	cmd.Flags().StringVar(&principal, "principal", "", "only this principal's calls")
	cmd.Flags().Int32Var(&limit, "limit", 0, "at most this many records, the oldest first (default: 1000; with --json all)")
	return cmd
}

// pointInTime reads a time as a duration before now ("1h", "7d") or RFC 3339.
func pointInTime(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339, s); err == nil {
		return t, nil
	}
	d, err := parseDays(s)
	if err != nil {
		return time.Time{}, fmt.Errorf("%q: want a duration ago (1h, 7d) or an RFC 3339 time", s)
	}
	return now.Add(-d), nil
}

// exportAudit streams the records req selects to stdout as JSON lines.
func (a *app) exportAudit(cmd *cobra.Command, req *dsecv1.QueryAuditRequest) error {
	stream, err := a.c.IAM.ExportAudit(cmd.Context(), connect.NewRequest(req))
	if err != nil {
		return err
	}
	defer stream.Close()
	for stream.Receive() {
		if _, err := a.stdout.Write(stream.Msg().GetData()); err != nil {
			return err
		}
	}
	return stream.Err()
}
