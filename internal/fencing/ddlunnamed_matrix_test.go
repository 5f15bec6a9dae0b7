package fencing_test

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// unnamedDDL are statements that drop, give away or change the extension
// membership of a table without naming it, or name it only as a member.
var unnamedDDL = []string{
	"DROP OWNED BY CURRENT_USER",
	"REASSIGN OWNED BY CURRENT_USER TO %[2]s",
	"ALTER EXTENSION hstore ADD TABLE public.%[1]s",
	"DROP DOMAIN public.fp_dom CASCADE",
	"DROP SCHEMA fp_ext CASCADE",
	"DO $$ BEGIN EXECUTE 'DROP ' || 'OWNED BY ' || quote_ident(current_user); END $$",
	"CREATE FUNCTION fp_drop() RETURNS void LANGUAGE sql AS $$ DROP OWNED BY CURRENT_USER $$",
}

// TestUnnamedDDLMatrix: TestDropOwned and TestStoredCodeDropOwned for a
// lock: optional table (with a lock named) and a lock: required one, as
// simple Queries, unnamed statements and named ones, with and without
// auto_prepare, each sent twice: every statement that could drop the
// protected table or change its owner or extension membership without
// naming it is refused (FP003), and the table, read directly, keeps its
// rows, owner, column of the domain and membership.
func TestUnnamedDDLMatrix(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	rs, err := rules.Compile(hijackRules)
	if err != nil {
		t.Fatal(err)
	}
	for _, auto := range []bool{false, true} {
		var edit []func(*proxy.Options)
		name := "auto_prepare off"
		if auto {
			edit, name = append(edit, autoPrepare), "auto_prepare on"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			p := startProxy(t, policy.New(rs, false, policy.Options{}), edit...)
			for _, proto := range []string{"simple", "unnamed", "named"} {
				t.Run(proto, func(t *testing.T) {
					t.Parallel()
					ctx := ctxT(t)
					db, d := catalogMatrixDB(t, "ddlmatrix", nil)
					owner, heir := "fp_dm_"+db, "fp_dmh_"+db
					if err := cluster.Exec(ctx, fmt.Sprintf("CREATE ROLE %[1]s LOGIN; CREATE ROLE %[2]s; GRANT %[2]s TO %[1]s", owner, heir)); err != nil {
						t.Fatal(err)
					}
					execDirect(t, d, fmt.Sprintf(`
GRANT CREATE ON DATABASE %[1]s TO %[2]s;
GRANT CREATE ON SCHEMA public TO %[2]s;
CREATE DOMAIN public.fp_dom AS int;
ALTER DOMAIN public.fp_dom OWNER TO %[2]s;
ALTER TABLE acct OWNER TO %[2]s;
ALTER TABLE racct OWNER TO %[2]s;
ALTER TABLE acct ADD COLUMN dom public.fp_dom;
ALTER TABLE racct ADD COLUMN dom public.fp_dom;
CREATE SCHEMA fp_ext AUTHORIZATION %[2]s;
SET ROLE %[2]s;
CREATE EXTENSION hstore SCHEMA public;
RESET ROLE`, db, owner))
					c := connectDSN(t, p.DSN(owner, "", db), func(c *pgx.ConnConfig) {
						c.RuntimeParams["fence.lock"] = "L/" + db
						c.RuntimeParams["fence.token"] = "5"
					})
					state := func() string {
						t.Helper()
						var s string
						err := d.QueryRow(ctx, `SELECT string_agg(format('%s owner=%s dom=%s member=%s', c.relname, pg_get_userbyid(c.relowner),
								EXISTS (SELECT FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attname = 'dom' AND NOT a.attisdropped),
								EXISTS (SELECT FROM pg_depend e WHERE e.classid = 'pg_class'::regclass AND e.objid = c.oid AND e.deptype = 'e')), ' ' ORDER BY c.relname)
							FROM pg_class c WHERE c.oid IN (to_regclass('public.acct'), to_regclass('public.racct'))`).Scan(&s)
						if err != nil {
							t.Fatal(err)
						}
						return s + " | " + tableText(t, d, "acct") + " | " + tableText(t, d, "racct")
					}
					before := state()
					for i, form := range unnamedDDL {
						for _, target := range []string{"acct", "racct"} {
							sql := fmt.Sprintf(form, target, heir)
							for n := range 2 {
								var err error
								if proto == "named" {
									_, err = c.PgConn().Prepare(ctx, fmt.Sprintf("dm%d_%s_%d", i, target, n), sql, nil)
									if err == nil {
										err = c.PgConn().ExecPrepared(ctx, fmt.Sprintf("dm%d_%s_%d", i, target, n), nil, nil, nil).Read().Err
									}
								} else {
									err = sendFunc(t, c.PgConn(), proto, "", sql)()
								}
								if code := sqlState(err); code != "FP003" {
									t.Errorf("%s, sending %d: %v (SQLSTATE %q), want FP003", sql, n+1, err, code)
								}
								if after := state(); after != before {
									t.Fatalf("%s: the tables changed:\n before %s\n after  %s", sql, before, after)
								}
							}
						}
					}
				})
			}
		})
	}
}
