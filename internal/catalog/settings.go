package catalog

import (
	"context"
	"fmt"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// settingsCodeSQL lists the code a statement may run that the server
// keeps as text or prints back as SQL, outside the system schemas and
// fenceproxy's own: the bodies of functions and procedures in every
// language but C and internal (PostgreSQL 14's SQL-standard bodies
// printed), with their arguments' defaults; views' and materialized
// views' queries; rules; column defaults and generated columns; check
// constraints of tables and domains, and domains' defaults; row
// security policies; triggers' definitions, with their WHEN conditions
// and the arguments their functions read as TG_ARGV (their functions are
// functions above). Each row is the object's description and its text.
func settingsCodeSQL(version int) string {
	body := "p.prosrc"
	if version >= 140000 {
		body = "coalesce(p.prosrc, '') || ' ' || coalesce(pg_catalog.pg_get_function_sqlbody(p.oid), '')"
	}
	const system = `NOT IN ('pg_catalog', 'information_schema', 'fenceproxy', 'pg_toast')`
	return `
		SELECT 'function ' || p.oid::pg_catalog.regprocedure::text,
			` + body + ` || ' ' || coalesce(pg_catalog.pg_get_function_arguments(p.oid), '')
		FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
		JOIN pg_catalog.pg_language l ON l.oid = p.prolang
		WHERE n.nspname ` + system + ` AND l.lanname NOT IN ('c', 'internal')
		UNION ALL
		SELECT 'view ' || c.oid::pg_catalog.regclass::text, coalesce(pg_catalog.pg_get_viewdef(c.oid), '')
		FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relkind IN ('v', 'm') AND n.nspname ` + system + `
		UNION ALL
		SELECT 'rule ' || r.rulename || ' on ' || c.oid::pg_catalog.regclass::text, coalesce(pg_catalog.pg_get_ruledef(r.oid), '')
		FROM pg_catalog.pg_rewrite r JOIN pg_catalog.pg_class c ON c.oid = r.ev_class
		JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE r.rulename <> '_RETURN' AND n.nspname ` + system + `
		UNION ALL
		SELECT 'default of ' || c.oid::pg_catalog.regclass::text, coalesce(pg_catalog.pg_get_expr(d.adbin, d.adrelid), '')
		FROM pg_catalog.pg_attrdef d JOIN pg_catalog.pg_class c ON c.oid = d.adrelid
		JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname ` + system + `
		UNION ALL
		SELECT 'constraint ' || con.conname, coalesce(pg_catalog.pg_get_constraintdef(con.oid), '')
		FROM pg_catalog.pg_constraint con JOIN pg_catalog.pg_namespace n ON n.oid = con.connamespace
		WHERE con.contype = 'c' AND n.nspname ` + system + `
		UNION ALL
		SELECT 'default of domain ' || t.oid::pg_catalog.regtype::text, coalesce(pg_catalog.pg_get_expr(t.typdefaultbin, 0), '')
		FROM pg_catalog.pg_type t JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace
		WHERE t.typdefaultbin IS NOT NULL AND n.nspname ` + system + `
		UNION ALL
		SELECT 'policy ' || pol.polname || ' on ' || c.oid::pg_catalog.regclass::text,
			coalesce(pg_catalog.pg_get_expr(pol.polqual, pol.polrelid), '') || ' ' || coalesce(pg_catalog.pg_get_expr(pol.polwithcheck, pol.polrelid), '')
		FROM pg_catalog.pg_policy pol JOIN pg_catalog.pg_class c ON c.oid = pol.polrelid
		JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname ` + system + `
		UNION ALL
		SELECT 'trigger ' || t.tgname || ' on ' || c.oid::pg_catalog.regclass::text, coalesce(pg_catalog.pg_get_triggerdef(t.oid), '')
		FROM pg_catalog.pg_trigger t JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
		JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE NOT t.tgisinternal AND n.nspname ` + system
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
// Not found: code that computes a setting's name from pieces (chr(102)),
// and functions in C. The result is the objects' descriptions, sorted as
// the server returned them, at most max (0: no limit), and whether any
// was found.
func SettingsReaders(ctx context.Context, q Querier, settings []string, max int) ([]string, bool, error) {
	var version int
	if err := q.QueryRow(ctx, "SELECT pg_catalog.current_setting('server_version_num')::int").Scan(&version); err != nil {
		return nil, false, fmt.Errorf("catalog: server version: %w", err)
	}
	words := settingsWords(settings)
	rows, err := q.Query(ctx, settingsCodeSQL(version))
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
