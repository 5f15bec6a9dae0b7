package catalog

import (
	"context"
	"fmt"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// settingsCodeSQL lists the code a statement may run that the server
// keeps as text or prints back as SQL, created after initdb (an OID from
// 16384 on: user objects wherever they are, pg_catalog and fenceproxy
// included, and none of PostgreSQL's own), but fenceproxy's own functions
// and procedures ($1, names in schema fenceproxy): the bodies of
// functions and procedures in every language but C and internal
// (PostgreSQL 14's SQL-standard bodies printed), with their arguments'
// defaults; views' and materialized views' queries; rules; column
// defaults and generated columns; check constraints of tables and
// domains, and domains' defaults; row security policies; triggers'
// definitions, with their WHEN conditions and the arguments their
// functions read as TG_ARGV (their functions are functions above). Each
// row is the object's description and its text.
func settingsCodeSQL(version int) string {
	return `
		SELECT 'function ' || p.oid::pg_catalog.regprocedure::text,
			` + functionBodySQL(version) + ` || ' ' || coalesce(pg_catalog.pg_get_function_arguments(p.oid), '')
		FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
		JOIN pg_catalog.pg_language l ON l.oid = p.prolang
		WHERE p.oid >= 16384 AND l.lanname NOT IN ('c', 'internal')
			AND NOT (n.nspname = 'fenceproxy' AND p.proname = ANY ($1::text[]))
		UNION ALL
		SELECT 'view ' || c.oid::pg_catalog.regclass::text, coalesce(pg_catalog.pg_get_viewdef(c.oid), '')
		FROM pg_catalog.pg_class c
		WHERE c.relkind IN ('v', 'm') AND c.oid >= 16384
		UNION ALL
		SELECT 'rule ' || r.rulename || ' on ' || r.ev_class::pg_catalog.regclass::text, coalesce(pg_catalog.pg_get_ruledef(r.oid), '')
		FROM pg_catalog.pg_rewrite r
		WHERE r.rulename <> '_RETURN' AND r.oid >= 16384
		UNION ALL
		SELECT 'default of ' || d.adrelid::pg_catalog.regclass::text, coalesce(pg_catalog.pg_get_expr(d.adbin, d.adrelid), '')
		FROM pg_catalog.pg_attrdef d
		WHERE d.oid >= 16384
		UNION ALL
		SELECT 'constraint ' || con.conname, coalesce(pg_catalog.pg_get_constraintdef(con.oid), '')
		FROM pg_catalog.pg_constraint con
		WHERE con.contype = 'c' AND con.oid >= 16384
		UNION ALL
		SELECT 'default of domain ' || t.oid::pg_catalog.regtype::text, coalesce(pg_catalog.pg_get_expr(t.typdefaultbin, 0), '')
		FROM pg_catalog.pg_type t
		WHERE t.typdefaultbin IS NOT NULL AND t.oid >= 16384
		UNION ALL
		SELECT 'policy ' || pol.polname || ' on ' || pol.polrelid::pg_catalog.regclass::text,
			coalesce(pg_catalog.pg_get_expr(pol.polqual, pol.polrelid), '') || ' ' || coalesce(pg_catalog.pg_get_expr(pol.polwithcheck, pol.polrelid), '')
		FROM pg_catalog.pg_policy pol
		WHERE pol.oid >= 16384
		UNION ALL
		SELECT 'trigger ' || t.tgname || ' on ' || t.tgrelid::pg_catalog.regclass::text, coalesce(pg_catalog.pg_get_triggerdef(t.oid), '')
		FROM pg_catalog.pg_trigger t
		WHERE NOT t.tgisinternal AND t.oid >= 16384`
}

// SettingsReaders lists the code of the database that may read one of
// the settings named (the token and lock settings, "fence.token"), so
// that a statement running it needs the session's values applied on the
// server even where the proxy writes the token into the statement
// itself: each object in settingsCodeSQL whose text names the first part
// of one (as a word, ASCII case ignored: "fence"), or pg_settings,
// pg_show_all_settings or SHOW, which list every setting, or holds a
// Unicode escape or a backslash, which may spell any name. The text is
// not parsed: a name in a comment or a string counts.
//
// own are the names of fenceproxy's functions and procedures in schema
// fenceproxy, which are not listed (the proxy knows what its own read).
//
// Not found: code that computes a setting's name from pieces (chr(102)),
// and functions in C. The result is the objects' descriptions, sorted as
// the server returned them, at most max (0: no limit), and whether any
// was found.
func SettingsReaders(ctx context.Context, q Querier, settings, own []string, max int) ([]string, bool, error) {
	var version int
	if err := q.QueryRow(ctx, "SELECT pg_catalog.current_setting('server_version_num')::int").Scan(&version); err != nil {
		return nil, false, fmt.Errorf("catalog: server version: %w", err)
	}
	words := settingsWords(settings)
	if own == nil {
		own = []string{}
	}
	rows, err := q.Query(ctx, settingsCodeSQL(version), own)
	if err != nil {
		return nil, false, fmt.Errorf("catalog: read code for setting reads: %w", err)
	}
	defer rows.Close()
	var out []string
	found := false
	for rows.Next() {
		var what, text string
		if err := rows.Scan(&what, &text); err != nil {
			return nil, false, fmt.Errorf("catalog: read code for setting reads: %w", err)
		}
		if sqllex.MayName(text, words) {
			found = true
			if max <= 0 || len(out) < max {
				out = append(out, what)
			}
		}
	}
	if err := rows.Err(); err != nil {
		return nil, false, fmt.Errorf("catalog: read code for setting reads: %w", err)
	}
	return out, found, nil
}

// settingsWords are the words whose presence in code means it may read
// one of settings: their first parts, and the names of what lists every
// setting.
func settingsWords(settings []string) []string {
	return append([]string{"pg_settings", "pg_show_all_settings", "show"}, sqllex.SettingParts(settings...)...)
}
