package fencing_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestDropOwned: as the (non-superuser) owner of a protected table, the
// statements that can drop it, move it, or change its owner or extension
// membership without naming it (DROP OWNED, REASSIGN OWNED, extensions,
// CASCADE) are refused through the proxy in both protocols, and the table
// keeps its rows, owner, schema, columns and membership; where no
// protected table applies, the same statements run and do what they do.
func TestDropOwned(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startEnv(t)
	db := e.newDB(t)
	ctx := ctxT(t)
	owner, heir := "fp_owner_"+db, "fp_heir_"+db
	if err := cluster.Exec(ctx, fmt.Sprintf("CREATE ROLE %[1]s LOGIN; CREATE ROLE %[2]s; GRANT %[2]s TO %[1]s", owner, heir)); err != nil {
		t.Fatal(err)
	}
	d := ownedSetup(t, db, owner)

	// Simple Query, and Parse/Bind/Execute of the unnamed statement.
	protocols := []struct {
		name string
		exec func(*pgx.Conn, string) error
	}{
		{"simple", func(c *pgx.Conn, sql string) error {
			_, err := c.PgConn().Exec(ctxT(t), sql).ReadAll()
			return err
		}},
		{"extended", func(c *pgx.Conn, sql string) error {
			return c.PgConn().ExecParams(ctxT(t), sql, nil, nil, nil, nil).Read().Err
		}},
	}
	refused := func(t *testing.T, member bool, stmts []string) {
		t.Helper()
		before := snapshot(t, d, tError)
		for _, p := range protocols {
			c := connectDSN(t, e.proxy.DSN(owner, "", db))
			for _, sql := range stmts {
				if p.name == "extended" && strings.Contains(sql, ";") {
					continue // one statement per Parse
				}
				err := p.exec(c, sql)
				if code := sqlState(err); code != "FP003" {
					t.Errorf("%s: %s: got %v (SQLSTATE %q), want FP003", p.name, sql, err, code)
				}
				selectOne(t, c)
				wantOwned(t, d, owner, member)
			}
		}
		wantUnchanged(t, d, tError, before)
	}

	t.Run("not-a-member", func(t *testing.T) {
		refused(t, false, []string{
			"ALTER EXTENSION hstore ADD TABLE acct",
			`ALTER EXTENSION "hstore" ADD TABLE public.acct`,
			"DROP OWNED BY CURRENT_USER",
			"drop owned by session_user cascade",
			"DROP OWNED BY CURRENT_ROLE RESTRICT",
			fmt.Sprintf(`DROP OWNED BY %s, "%s"`, heir, owner),
			"REASSIGN OWNED BY CURRENT_USER TO " + heir,
			"REASSIGN OWNED BY CURRENT_USER TO " + heir + "; DROP OWNED BY CURRENT_USER",
			"SELECT 1; DROP OWNED BY CURRENT_USER",
			"DROP DOMAIN fp_dom CASCADE", // would drop acct.dom
			"DROP SCHEMA fp_ext CASCADE",
		})
	})

	// The table made a member of the extension on a direct connection.
	if _, err := d.Exec(ctx, "ALTER EXTENSION hstore ADD TABLE public.acct"); err != nil {
		t.Fatal(err)
	}
	t.Run("member", func(t *testing.T) {
		refused(t, true, []string{
			"DROP EXTENSION hstore",
			"DROP EXTENSION IF EXISTS hstore CASCADE",
			"ALTER EXTENSION hstore SET SCHEMA fp_ext",
			"ALTER EXTENSION hstore DROP TABLE acct",
			"ALTER EXTENSION hstore UPDATE",
			"DROP OWNED BY CURRENT_USER",
		})
	})

	// Transparency: a proxy whose rules apply to the first database only.
	t.Run("no-protected-table-applies", func(t *testing.T) {
		simple, extended := e.newDB(t), e.newDB(t)
		rs, err := rules.Compile(rules.Config{Tables: []rules.Table{
			{Table: "public." + tError, Scope: rules.Scope{Databases: []string{db}}},
		}})
		if err != nil {
			t.Fatal(err)
		}
		p := startProxy(t, policy.New(rs, false, policy.Options{}))
		// Still refused where the rules apply.
		c := connectDSN(t, p.DSN(owner, "", db))
		_, err = c.PgConn().Exec(ctxT(t), "DROP OWNED BY CURRENT_USER").ReadAll()
		wantCode(t, err, "FP003")
		wantOwned(t, d, owner, true)

		for i, name := range []string{simple, extended} {
			pr := protocols[i]
			d := ownedSetup(t, name, owner)
			c := connectDSN(t, p.DSN(owner, "", name))
			run := func(sql string) {
				t.Helper()
				if err := pr.exec(c, sql); err != nil {
					t.Fatalf("%s: %s: %v", pr.name, sql, err)
				}
			}
			has := func(query string) bool {
				t.Helper()
				var ok bool
				if err := d.QueryRow(ctxT(t), "SELECT EXISTS ("+query+")").Scan(&ok); err != nil {
					t.Fatal(err)
				}
				return ok
			}
			run("DROP DOMAIN fp_dom CASCADE")
			if has(ownedQueries["dom"]) {
				t.Errorf("%s: DROP DOMAIN ... CASCADE kept acct.dom", pr.name)
			}
			run("ALTER EXTENSION hstore ADD TABLE acct")
			if !has(ownedQueries["member"]) {
				t.Errorf("%s: acct is not a member of hstore", pr.name)
			}
			run("ALTER EXTENSION hstore DROP TABLE acct")
			run("REASSIGN OWNED BY CURRENT_USER TO " + heir)
			if !has(fmt.Sprintf(ownedQueries["owner"], heir)) {
				t.Errorf("%s: REASSIGN OWNED left acct's owner", pr.name)
			}
			run("REASSIGN OWNED BY " + heir + " TO CURRENT_USER")
			run("ALTER EXTENSION hstore ADD TABLE acct")
			run("DROP EXTENSION hstore")
			if has(ownedQueries["exists"]) {
				t.Errorf("%s: DROP EXTENSION kept its member acct", pr.name)
			}
			run("DROP OWNED BY CURRENT_USER")
			if has("SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = 'fp_ext'") {
				t.Errorf("%s: DROP OWNED kept schema fp_ext", pr.name)
			}
		}
	})
}

// ownedSetup makes owner the owner of acct in db, with a column of a
// domain owner owns, a schema of owner's and the trusted extension hstore
// created by owner; it returns a direct connection to db.
func ownedSetup(t *testing.T, db, owner string) *pgx.Conn {
	t.Helper()
	d := direct(t, db)
	sql := fmt.Sprintf(`
GRANT CREATE ON DATABASE %[1]s TO %[2]s;
GRANT CREATE ON SCHEMA public TO %[2]s;
ALTER TABLE public.acct OWNER TO %[2]s;
CREATE DOMAIN public.fp_dom AS int;
ALTER DOMAIN public.fp_dom OWNER TO %[2]s;
ALTER TABLE public.acct ADD COLUMN dom public.fp_dom;
CREATE SCHEMA fp_ext AUTHORIZATION %[2]s;
SET ROLE %[2]s;
CREATE EXTENSION hstore SCHEMA public;
RESET ROLE;
`, db, owner)
	if _, err := d.PgConn().Exec(ctxT(t), sql).ReadAll(); err != nil {
		t.Fatalf("setup: %v", err)
	}
	return d
}

// ownedQueries are the facts wantOwned reads, as EXISTS subqueries.
var ownedQueries = map[string]string{
	"exists": "SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND c.relname = 'acct'",
	"owner":  "SELECT 1 FROM pg_catalog.pg_class WHERE oid = 'public.acct'::regclass AND pg_catalog.pg_get_userbyid(relowner) = '%s'",
	"dom":    "SELECT 1 FROM pg_catalog.pg_attribute WHERE attrelid = 'public.acct'::regclass AND attname = 'dom' AND NOT attisdropped",
	"member": "SELECT 1 FROM pg_catalog.pg_depend WHERE classid = 'pg_catalog.pg_class'::regclass AND objid = 'public.acct'::regclass AND deptype = 'e'",
	"hstore": "SELECT 1 FROM pg_catalog.pg_extension e JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'hstore' AND n.nspname = 'public'",
}

// wantOwned checks through d, a direct connection, that public.acct still
// exists in schema public, owned by owner, with its column dom, a member
// of hstore or not as member says, and that hstore is still in public.
func wantOwned(t *testing.T, d *pgx.Conn, owner string, member bool) {
	t.Helper()
	for _, k := range []string{"exists", "owner", "dom", "member", "hstore"} {
		q := ownedQueries[k]
		if k == "owner" {
			q = fmt.Sprintf(q, owner)
		}
		var ok bool
		if err := d.QueryRow(ctxT(t), "SELECT EXISTS ("+q+")").Scan(&ok); err != nil {
			t.Fatalf("%s: %v", k, err)
		}
		if want := k != "member" || member; ok != want {
			t.Fatalf("%s: got %v, want %v", k, ok, want)
		}
	}
}
