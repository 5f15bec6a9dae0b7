package dbsetup

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/catalog"
)

// The catalog watch (watch.sql): two event triggers, on ddl_command_end
// and sql_drop, that count every change of the catalog that may open a
// path to a protected table in fenceproxy.catalog, in the changing
// transaction, and notify CatalogChannel. The checks read the count (the
// stamp) before they read the paths; the proxy has CatalogCheckProc
// compare it in the write's transaction (or reads it itself before it
// forwards the write), and checks again when it has moved. See
// docs/design.md, "Catalog changes while the proxy runs".

// watchSQL is watch.sql: the stamp's table, the triggers' function and
// the check procedure.
//
//go:embed watch.sql
var watchSQL string

// watchBody is the triggers' function's source, as pg_proc.prosrc keeps it.
var watchBody = dollarBody(watchSQL, "body")

// watchV1SQL is catalog_changed as setup installed it before it counted
// renames tagged ALTER INDEX; a watch with it is still in place until
// setup replaces it.
//
//go:embed watch_v1.sql
var watchV1SQL string

var watchBodyV1 = dollarBody(watchV1SQL, "body")

// watchV2SQL is catalog_changed as setup installed it before it counted
// temporary views, their rules and triggers.
//
//go:embed watch_v2.sql
var watchV2SQL string

var watchBodyV2 = dollarBody(watchV2SQL, "body")

// watchBodyV3 is catalog_changed as setup installed it before it counted
// temporary functions and procedures: watchBody with the list of
// temporary objects it counts as it was (tempCounted).
var watchBodyV3 = tempCounted.replace(watchBody)

// tempCounted is the list of the temporary objects catalog_changed
// counts, now and before temporary functions and procedures.
var tempCounted = bodyEdit{
	now:    "object_type IN ('view', 'rule', 'trigger', 'function', 'procedure')) THEN",
	before: "object_type IN ('view', 'rule', 'trigger')) THEN",
}

// watchV3SQL is catalog_at as setup installed it before it set
// lock_timeout while another transaction's change of the catalog is under
// way: still a check the proxy calls, until setup replaces it.
//
//go:embed watch_v3.sql
var watchV3SQL string

var catalogCheckBodyV3 = dollarBody(watchV3SQL, "at")

// CatalogCheckProc is the procedure of watch.sql the proxy calls in a
// write's transaction, just before the write, with the stamp it decided
// the write under: it raises FP003 when the catalog stamp is another.
// It is catalog_is with its common case made cheap; watch.sql keeps
// catalog_is, which proxies of earlier versions call, and which this one
// calls where setup last ran with an earlier version (Report.CheckProc).
const CatalogCheckProc = "fenceproxy.catalog_at"

// LegacyCatalogCheckProc is the check procedure of watches that setup
// installed before CatalogCheckProc: the proxy calls it where the watch
// has not been upgraded yet, so that an upgrade of the proxy never leaves
// a database unwatched.
const LegacyCatalogCheckProc = "fenceproxy.catalog_is"

// catalogCheckBody is CatalogCheckProc's source.
var catalogCheckBody = dollarBody(watchSQL, "at")

// legacyCheckBody is LegacyCatalogCheckProc's source.
var legacyCheckBody = dollarBody(watchSQL, "check")

// CatalogChannel is the channel the catalog watch notifies in the
// transaction of each change it counts.
const CatalogChannel = "fenceproxy_catalog"

// The event triggers, one per event.
const (
	watchDDLTrigger  = "fenceproxy_catalog_ddl"
	watchDropTrigger = "fenceproxy_catalog_drop"
)

// watchTriggersSQL creates the event triggers afresh. ENABLE ALWAYS: they
// fire under session_replication_role = replica too, which restores and
// replication tools set.
const watchTriggersSQL = `
DROP EVENT TRIGGER IF EXISTS ` + watchDDLTrigger + `;
DROP EVENT TRIGGER IF EXISTS ` + watchDropTrigger + `;
CREATE EVENT TRIGGER ` + watchDDLTrigger + ` ON ddl_command_end EXECUTE FUNCTION fenceproxy.catalog_changed();
CREATE EVENT TRIGGER ` + watchDropTrigger + ` ON sql_drop EXECUTE FUNCTION fenceproxy.catalog_changed();
ALTER EVENT TRIGGER ` + watchDDLTrigger + ` ENABLE ALWAYS;
ALTER EVENT TRIGGER ` + watchDropTrigger + ` ENABLE ALWAYS;
`

// readWatch returns the check procedure of the catalog watch if the watch
// is in place as watch.sql and watchTriggersSQL install it, or as an
// earlier version did: the stamp's table with its row and columns, the
// function with this source (or watch_v1.sql's, watch_v2.sql's, watchBodyV3) and declaration, both
// event triggers calling it, enabled always, for every command, and a
// check procedure with its source (or, for CatalogCheckProc, watch_v3.sql's),
// CatalogCheckProc or LegacyCatalogCheckProc. It returns "" when the watch is not in place,
// and current when it is this version's, which setup need not touch.
func readWatch(ctx context.Context, q catalog.Querier) (proc string, current bool, err error) {
	var table, ok bool
	var bodyCurrent bool
	err = q.QueryRow(ctx, `
		WITH f AS (
			SELECT p.oid, p.prosrc = $1 AS current FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
			WHERE n.nspname = 'fenceproxy' AND p.proname = 'catalog_changed' AND p.pronargs = 0
				AND p.prorettype = 'pg_catalog.event_trigger'::pg_catalog.regtype
				AND p.prosrc IN ($1, $8, $9, $11) AND p.prosecdef AND p.proconfig = ARRAY['search_path=pg_catalog, pg_temp']),
		t AS (
			SELECT c.oid FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
			WHERE n.nspname = 'fenceproxy' AND c.relname = 'catalog' AND c.relkind = 'r'),
		checks AS (
			SELECT p.proname::text AS name, p.prosrc, p.proconfig FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
			WHERE n.nspname = 'fenceproxy' AND p.proname IN ('catalog_at', 'catalog_is') AND p.prokind = 'p'
				AND p.proargtypes = '20'::pg_catalog.oidvector AND NOT p.prosecdef)
		SELECT EXISTS (SELECT FROM t WHERE (SELECT count(*) FROM pg_catalog.pg_attribute a
					WHERE a.attrelid = t.oid AND NOT a.attisdropped AND a.atttypid = 'pg_catalog.int8'::pg_catalog.regtype
					AND a.attname IN ('stamp', 'base', 'writer')) = 3),
			(SELECT count(*) FROM pg_catalog.pg_event_trigger e JOIN f ON e.evtfoid = f.oid
				WHERE e.evtenabled = 'A' AND e.evttags IS NULL
				AND ((e.evtname = $2::text AND e.evtevent = 'ddl_command_end')
					OR (e.evtname = $3::text AND e.evtevent = 'sql_drop'))) = 2,
			CASE WHEN EXISTS (SELECT FROM checks WHERE name = 'catalog_at' AND prosrc IN ($4, $10) AND proconfig IS NULL) THEN $6
				WHEN EXISTS (SELECT FROM checks WHERE name = 'catalog_is' AND prosrc = $5
					AND proconfig = ARRAY['search_path=pg_catalog, pg_temp']) THEN $7
				ELSE '' END,
			coalesce((SELECT bool_and(current) FROM f), false)
				AND EXISTS (SELECT FROM checks WHERE name = 'catalog_at' AND prosrc = $4)`,
		watchBody, watchDDLTrigger, watchDropTrigger, catalogCheckBody, legacyCheckBody,
		CatalogCheckProc, LegacyCatalogCheckProc, watchBodyV1, watchBodyV2, catalogCheckBodyV3, watchBodyV3).Scan(&table, &ok, &proc, &bodyCurrent)
	if err != nil {
		return "", false, fmt.Errorf("read the catalog watch: %w", err)
	}
	if !table || !ok || proc == "" {
		return "", false, nil
	}
	// The row: without it the first change creates it, but a check that
	// read no stamp has nothing to compare with.
	var rows int
	if err := q.QueryRow(ctx, `SELECT count(*) FROM fenceproxy.catalog`).Scan(&rows); err != nil {
		return "", false, fmt.Errorf("read the catalog watch: %w", err)
	}
	if rows != 1 {
		return "", false, nil
	}
	return proc, bodyCurrent && proc == CatalogCheckProc, nil
}

// installWatch installs or repairs the catalog watch when the connecting
// role is a superuser (only superusers may create event triggers), and
// notes it when it cannot.
func installWatch(ctx context.Context, tx pgx.Tx, rep *Report) error {
	proc, current, err := readWatch(ctx, tx)
	if err != nil || current {
		return err
	}
	var super bool
	if err := tx.QueryRow(ctx, `SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user`).Scan(&super); err != nil {
		return fmt.Errorf("read the connecting role: %w", err)
	}
	if !super && proc != "" {
		rep.Notes = append(rep.Notes, Note{Text: "the catalog watch is of an earlier version (it may not count every change that opens a path, " +
			"and its check may cost writes more); run fenceproxy setup as a superuser once to upgrade it"})
		return nil
	}
	if !super {
		rep.Notes = append(rep.Notes, Note{Text: "the catalog watch (event triggers) needs a superuser: without it, a view, rule, " +
			"parent or foreign key created later on another connection is seen by the proxy at its next check only; run fenceproxy setup as a superuser once"})
		return nil
	}
	if _, err := tx.Exec(ctx, watchSQL); err != nil {
		return fmt.Errorf("install the catalog watch: %w", err)
	}
	if _, err := tx.Exec(ctx, watchTriggersSQL); err != nil {
		return fmt.Errorf("install the catalog watch: %w", err)
	}
	if proc != "" {
		rep.Actions = append(rep.Actions, "upgraded the catalog watch")
		return nil
	}
	rep.Actions = append(rep.Actions, "installed the catalog watch (event triggers "+watchDDLTrigger+" and "+watchDropTrigger+")")
	return nil
}

// ReadStamp returns the catalog stamp of the database conn is connected
// to, as of the statement's snapshot. It fails where the catalog watch
// was never installed.
func ReadStamp(ctx context.Context, conn *pgx.Conn) (int64, error) {
	var s int64
	err := conn.QueryRow(ctx, `SELECT stamp FROM fenceproxy.catalog`).Scan(&s)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, errors.New("dbsetup: fenceproxy.catalog has no row")
	}
	if err != nil {
		return 0, fmt.Errorf("dbsetup: read the catalog stamp: %w", err)
	}
	return s, nil
}

// ownFunctions are the names of the functions and procedures setup
// installs in schema fenceproxy, now or in an earlier version (the SQL
// files above), which the check of code reading the fence settings
// leaves out (catalog.SettingsReaders): the proxy knows what they read.
var ownFunctions = func() []string {
	re := regexp.MustCompile(`(?i)(?:FUNCTION|PROCEDURE)\s+fenceproxy\.([a-z_0-9]+)\s*\(`)
	var out []string
	for _, src := range []string{objectsSQL, registerV1SQL, watchSQL, watchV1SQL, watchV2SQL, watchV3SQL} {
		for _, m := range re.FindAllStringSubmatch(src, -1) {
			if n := strings.ToLower(m[1]); !slices.Contains(out, n) {
				out = append(out, n)
			}
		}
	}
	return out
}()
