package fencing_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestEncodings checks the splicing guarantee end to end: for every client
// encoding PostgreSQL accepts, every standard_conforming_strings and every
// backslash_quote, a statement through the proxy stores exactly what the
// same statement stores sent directly, or is refused with FP003 and stores
// nothing. The statements are built as bytes in the client encoding (by
// PostgreSQL's own convert_to) and sent with pgconn, in the simple
// protocol and the extended one (without and with text parameters).
//
// Each statement runs four times, each against a table holding the same
// rows: through the proxy on the protected acct; directly on plain (an
// unprotected copy); through the proxy on ctl (unprotected, a name no rule
// mentions: it must be forwarded as sent, so it must store what plain
// stores, error for error); and through the proxy on other.acct
// (unprotected, but named like a protected table: as plain, or FP003).
//
// Each encoding works in a database of its own, as a parallel subtest.
func TestEncodings(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	e := startEnv(t)
	rs, err := rules.Compile(testRules)
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t)
	admin := direct(t, "postgres")

	// Every encoding PostgreSQL knows: the ones with conversions, UTF8 and
	// SQL_ASCII, and (to miss none) every id pg_encoding_to_char names.
	rows, err := admin.Query(ctx, `
SELECT DISTINCT e FROM (
	SELECT pg_encoding_to_char(conforencoding) FROM pg_conversion
	UNION ALL SELECT 'UTF8' UNION ALL SELECT 'SQL_ASCII'
	UNION ALL SELECT pg_encoding_to_char(i) FROM generate_series(0, 63) i
) s(e) WHERE e <> '' ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	var all []string
	for rows.Next() {
		var enc string
		if err := rows.Scan(&enc); err != nil {
			t.Fatal(err)
		}
		all = append(all, enc)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}

	// The encodings PostgreSQL refuses as client encodings (with its own
	// error) are skipped, and listed.
	var encs, refused []string
	for _, enc := range all {
		_, err := admin.PgConn().Exec(ctx, "SET client_encoding = '"+enc+"'").ReadAll()
		if err != nil {
			var pe *pgconn.PgError
			if !errors.As(err, &pe) {
				t.Fatalf("SET client_encoding = %s: %v", enc, err)
			}
			refused = append(refused, fmt.Sprintf("%s (%s %s)", enc, pe.Code, pe.Message))
			continue
		}
		if _, err := admin.PgConn().Exec(ctx, "RESET client_encoding").ReadAll(); err != nil {
			t.Fatal(err)
		}
		encs = append(encs, enc)
	}
	t.Logf("client encodings tested (%d): %s", len(encs), strings.Join(encs, " "))
	t.Logf("refused by PostgreSQL as client encodings: %s", strings.Join(refused, "; "))
	if len(encs) < 30 {
		t.Fatalf("only %d client encodings accepted: %v", len(encs), encs)
	}

	// The encodings run side by side, more of them than -parallel (the
	// machine's CPUs) would allow: they mostly wait for round trips. Run
	// may be called from several goroutines at once.
	work := make(chan string)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for enc := range work {
				t.Run(enc, func(t *testing.T) { testEncoding(t, e, rs, enc) })
			}
		})
	}
	for _, enc := range encs {
		work <- enc
	}
	close(work)
	wg.Wait()
}

// samples are characters tried in every encoding; each one the encoding
// has goes into its non-ASCII sample. 表 and ソ are 0x95 0x5C and 0x83 0x5C
// in SJIS: their second byte is a backslash.
var samples = []string{"表", "ソ", "é", "Á", "Ω", "я", "中", "한", "ก", "א", "ع", "€", "ｿ"}

// encTemplate is a statement with placeholders, replaced per table, mode
// and encoding: {T} the table, {ID} the row id (a parameter in the
// parameter mode), {X} the encoding's non-ASCII sample, {P} a text value
// (a literal of {X}, or a parameter in the parameter mode).
type encTemplate struct {
	name   string
	sql    string
	insert bool // the statement inserts row 1 (else it updates row 1)
}

var encTemplates = []encTemplate{
	{name: "unicode escape", sql: `UPDATE {T} SET payload = E'caf\u00e9' WHERE id = {ID}`},
	{name: "escape ending in backslash", sql: `UPDATE {T} SET payload = E'\u00C1\\' WHERE id = {ID}`},
	{name: "SJIS attack shape", sql: `UPDATE {T} SET payload = E'\u00C1\\', n = 5 WHERE id = {ID} --'`},
	{name: "misread smuggles second statement", sql: `UPDATE {T} SET payload = E'\u00C1\\' || '; UPDATE acct SET n = 99; --', n = 5 WHERE id = {ID}`},
	{name: "two statements", sql: `UPDATE {T} SET payload = E'\u00C1\\' WHERE id = {ID}; UPDATE {T} SET n = n + 1 WHERE id = {ID}`},
	{name: "U& escape", sql: `UPDATE {T} SET payload = U&'\00e9' WHERE id = {ID}`},
	{name: "doubled quote", sql: `UPDATE {T} SET payload = 'it''s' WHERE id = {ID}`},
	{name: "escaped backslash", sql: `UPDATE {T} SET payload = E'\\' WHERE id = {ID}`},
	{name: "backslash quote", sql: `UPDATE {T} SET payload = E'\'' WHERE id = {ID}`},
	{name: "backslash quote in plain literal", sql: `UPDATE {T} SET payload = 'x\'' WHERE id = {ID} --'`},
	{name: "dollar quote with backslash", sql: `UPDATE {T} SET payload = $$a\$$ WHERE id = {ID}`},
	{name: "tagged dollar quote", sql: `UPDATE {T} SET payload = $q$ ' $q$ WHERE id = {ID}`},
	{name: "block comment with quote", sql: `UPDATE {T} SET payload = 'c' /* ' */ WHERE id = {ID}`},
	{name: "line comment with quote", sql: "UPDATE {T} SET payload = 'c' -- '\nWHERE id = {ID}"},
	{name: "literal ending in backslash", sql: `UPDATE {T} SET payload = 'x\' WHERE id = {ID} --'`},
	{name: "literal ending in backslash unterminated", sql: `UPDATE {T} SET payload = 'x\' WHERE id = {ID}`},
	{name: "non-ASCII literal", sql: `UPDATE {T} SET payload = '{X}' WHERE id = {ID}`},
	{name: "non-ASCII escape string ending in backslash", sql: `UPDATE {T} SET payload = E'{X}\\', n = 5 WHERE id = {ID} --'`},
	{name: "non-ASCII literal before quote", sql: `UPDATE {T} SET payload = '{X}''', n = 5 WHERE id = {ID} --'`},
	{name: "non-ASCII comments", sql: "UPDATE {T} SET payload = 'c' /* {X} */ WHERE id = {ID} -- {X}\n"},
	{name: "non-ASCII dollar quote", sql: `UPDATE {T} SET payload = $${X}$$ WHERE id = {ID}`},
	{name: "value", sql: `UPDATE {T} SET payload = {P} || E'\\' WHERE id = {ID}`},
	{name: "insert unicode escape", insert: true, sql: `INSERT INTO {T} (id, payload) VALUES ({ID}, E'caf\u00e9')`},
	{name: "insert SJIS attack shape", insert: true, sql: `INSERT INTO {T} (id, payload, n) VALUES ({ID}, E'\u00C1\\', 5) --'`},
	{name: "insert two rows", insert: true, sql: `INSERT INTO {T} (id, payload) VALUES ({ID}, 'it''s'), ({ID} + 1, $q$ ' $q$)`},
	{name: "insert literal ending in backslash", insert: true, sql: `INSERT INTO {T} (id, payload) VALUES ({ID}, 'x\') --')`},
	{name: "insert non-ASCII", insert: true, sql: `INSERT INTO {T} (id, payload) VALUES ({ID}, '{X}') -- {X}`},
	{name: "insert value", insert: true, sql: `INSERT INTO {T} (id, payload) VALUES ({ID}, {P})`},
}

// encMode is how a statement is sent.
type encMode int

const (
	modeSimple   encMode = iota // Query
	modeExtended                // Parse/Bind/Execute, no parameters
	modeParams                  // Parse/Bind/Execute, {ID} and {P} as text parameters
)

func (m encMode) String() string { return [...]string{"simple", "extended", "params"}[m] }

// encSettings are the lexing settings of one round.
type encSettings struct {
	scs, bq string
}

var encRounds = func() []encSettings {
	var s []encSettings
	for _, scs := range []string{"on", "off"} {
		for _, bq := range []string{"on", "off", "safe_encoding"} {
			s = append(s, encSettings{scs, bq})
		}
	}
	return s
}()

// testEncoding runs the templates in client encoding enc, in a database
// of its own, under the settings and in the modes that can matter to each.
func testEncoding(t *testing.T, e *env, rs *rules.Rules, enc string) {
	db := e.newDB(t)
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	admin := direct(t, db)
	// ctl is unprotected and named unlike any rule; plain is where the
	// statements run directly.
	if _, err := admin.PgConn().Exec(ctx, `CREATE TABLE plain (LIKE acct INCLUDING ALL); CREATE TABLE ctl (LIKE acct INCLUDING ALL)`).ReadAll(); err != nil {
		t.Fatal(err)
	}

	// The encoding's sample: every sample character it has, in its bytes.
	var x []byte
	var have []string
	for _, ch := range samples {
		var b []byte
		if err := admin.QueryRow(ctx, "SELECT convert_to($1, $2)", ch, enc).Scan(&b); err != nil {
			continue // no such character in enc
		}
		x = append(x, b...)
		have = append(have, ch)
	}
	if len(x) == 0 {
		t.Fatalf("no sample character converts to %s", enc)
	}
	t.Logf("%s sample %s = % x", enc, strings.Join(have, ""), x)

	connect := func(dsn string) *pgconn.PgConn {
		c, err := pgconn.Connect(ctx, dsn)
		if err != nil {
			t.Fatalf("connect: %v", err)
		}
		t.Cleanup(func() { _ = c.Close(context.Background()) })
		return c
	}
	// One session per table, so the four run side by side.
	proxyDSN := e.proxy.DSN("postgres", "", db)
	targets := []struct {
		table string
		conn  *pgconn.PgConn
	}{
		{"acct", connect(proxyDSN)},
		{"plain", connect(cluster.SuperuserDSN(db))},
		{"ctl", connect(proxyDSN)},
		{"other.acct", connect(proxyDSN)},
	}
	if _, err := targets[0].conn.Exec(ctx, "SET fence.token = '5'").ReadAll(); err != nil {
		t.Fatal(err)
	}

	type step struct {
		set  encSettings
		tpl  encTemplate
		mode encMode
	}
	// Every template in the simple protocol under every setting that can
	// matter to it; in the extended protocol under the defaults (the
	// settings are read by the same lexer whichever protocol carries the
	// text).
	var steps []step
	for _, set := range encRounds {
		for _, tpl := range encTemplates {
			for _, mode := range []encMode{modeSimple, modeExtended, modeParams} {
				// backslash_quote only concerns \' (PostgreSQL's
				// scan.l checks it there alone).
				if set.bq != "safe_encoding" && !strings.Contains(tpl.sql, `\`) {
					continue
				}
				if mode == modeSimple || set.bq == "safe_encoding" && set.scs == "on" {
					steps = append(steps, step{set, tpl, mode})
				}
			}
		}
	}
	resetEncTables(t, ctx, admin.PgConn(), nil, steps[0].tpl.insert)
	var current encSettings
	var tally struct{ same, sameError, refused int }
	defer func() {
		t.Logf("%s: %d statements: %d stored the same as directly, %d failed as directly, %d refused with FP003",
			enc, len(steps), tally.same, tally.sameError, tally.refused)
	}()
	for i, st := range steps {
		set, tpl, mode := st.set, st.tpl, st.mode
		if set != current {
			current = set
			setSQL := fmt.Sprintf("SET client_encoding = '%s'; SET standard_conforming_strings = %s; SET backslash_quote = %s", enc, set.scs, set.bq)
			for _, tg := range targets {
				if _, err := tg.conn.Exec(ctx, setSQL).ReadAll(); err != nil {
					t.Fatalf("%s: %v", setSQL, err)
				}
			}
		}
		where := fmt.Sprintf("%s, standard_conforming_strings %s, backslash_quote %s, %s, %q", enc, set.scs, set.bq, mode, tpl.name)
		codes := make([]string, len(targets))
		sqls := make([][]byte, len(targets))
		var wg sync.WaitGroup
		for i, tg := range targets {
			sql, params := tpl.build(tg.table, mode, x)
			sqls[i] = sql
			wg.Go(func() { codes[i] = runEnc(ctx, tg.conn, mode, sql, params) })
		}
		wg.Wait()
		// Read what the statement stored, and set the tables up for the
		// next one, in one round trip.
		stored := map[string]string{}
		nextInsert := i+1 < len(steps) && steps[i+1].tpl.insert
		resetEncTables(t, ctx, admin.PgConn(), stored, nextInsert)
		got, want, ctl, oth := stored["acct"], stored["plain"], stored["ctl"], stored["other.acct"]
		before := "{}"
		if !tpl.insert {
			before = "{1 61 n=0}"
		}
		sql := sqls[0]
		expectRefusal := bytes.IndexByte(sql, '\\') >= 0 && set.scs == "off" || hasHigh(sql) && enc != "UTF8"
		// The unprotected control is forwarded as sent, unless the proxy's
		// cheap pre-filter (a protected name or U& in the text) cannot
		// rule out a protected table, and the lexing is ambiguous.
		ctlRefusable := rs.MayTouch(string(sqls[2]))
		if !(codes[2] == codes[1] && ctl == want || ctlRefusable && codes[2] == rules.CodeRefused && ctl == before) {
			t.Errorf("%s: unprotected ctl through the proxy: %s stored %s; directly: %s stored %s\nstatement: %q",
				where, codeOr(codes[2]), ctl, codeOr(codes[1]), want, sqls[2])
		}
		if !(codes[3] == codes[1] && oth == want || codes[3] == rules.CodeRefused && oth == before) {
			t.Errorf("%s: unprotected other.acct through the proxy: %s stored %s; directly: %s stored %s\nstatement: %q",
				where, codeOr(codes[3]), oth, codeOr(codes[1]), want, sqls[3])
		}
		switch {
		case codes[0] == rules.CodeRefused:
			tally.refused++
		case codes[0] == "":
			tally.same++
		default:
			tally.sameError++
		}
		switch {
		case codes[0] == rules.CodeRefused:
			if got != before {
				t.Errorf("%s: refused with FP003 but acct holds %s (before: %s)\nstatement: %q", where, got, before, sql)
			}
			if !expectRefusal {
				t.Errorf("%s: refused with FP003 though the lexing is unambiguous; directly: %s stored %s\nstatement: %q", where, codeOr(codes[1]), want, sql)
			}
		case expectRefusal:
			t.Errorf("%s: not refused: %s stored %s (directly: %s stored %s)\nstatement: %q", where, codeOr(codes[0]), got, codeOr(codes[1]), want, sql)
		case codes[0] != codes[1] || got != want:
			t.Errorf("%s: through the proxy %s stored %s; directly %s stored %s\nstatement: %q",
				where, codeOr(codes[0]), got, codeOr(codes[1]), want, sql)
		}
	}
}

// build returns the template's statement for table in mode, in the bytes
// of the encoding whose sample is x, with its parameter values.
func (tpl encTemplate) build(table string, mode encMode, x []byte) ([]byte, [][]byte) {
	sql := []byte(tpl.sql)
	var params [][]byte
	sql = bytes.ReplaceAll(sql, []byte("{T}"), []byte(table))
	if mode == modeParams {
		sql = bytes.ReplaceAll(sql, []byte("{ID}"), []byte("$1::text::bigint"))
		params = append(params, []byte("1"))
		if bytes.Contains(sql, []byte("{P}")) {
			sql = bytes.ReplaceAll(sql, []byte("{P}"), []byte("$2::text"))
			params = append(params, x)
		}
	} else {
		sql = bytes.ReplaceAll(sql, []byte("{ID}"), []byte("1"))
		sql = bytes.ReplaceAll(sql, []byte("{P}"), []byte("'{X}'"))
	}
	sql = bytes.ReplaceAll(sql, []byte("{X}"), x)
	return sql, params
}

// runEnc sends sql through c in mode and returns the SQLSTATE of its
// failure, or "".
func runEnc(ctx context.Context, c *pgconn.PgConn, mode encMode, sql []byte, params [][]byte) string {
	var err error
	switch mode {
	case modeSimple:
		_, err = c.Exec(ctx, string(sql)).ReadAll()
	case modeExtended:
		err = c.ExecParams(ctx, string(sql), nil, nil, nil, nil).Read().Err
	case modeParams:
		oids := make([]uint32, len(params))
		for i := range oids {
			oids[i] = 25 // text
		}
		err = c.ExecParams(ctx, string(sql), params, oids, nil, nil).Read().Err
	}
	if err == nil {
		return ""
	}
	if code := sqlState(err); code != "" {
		return code
	}
	return "non-PostgreSQL error: " + err.Error()
}

func codeOr(code string) string {
	if code == "" {
		return "success"
	}
	return "error " + code
}

func hasHigh(b []byte) bool {
	for _, c := range b {
		if c >= 0x80 {
			return true
		}
	}
	return false
}

var encTables = []string{"acct", "plain", "ctl", "other.acct"}

// resetEncTables reads the four tables' rows into stored (unless nil),
// as id, payload bytes in UTF-8 as hex and n, then empties them and gives
// them row 1 'a' unless the next statement inserts it; in one round trip
// through c, a direct UTF-8 connection.
func resetEncTables(t *testing.T, ctx context.Context, c *pgconn.PgConn, stored map[string]string, forInsert bool) {
	t.Helper()
	var b strings.Builder
	if stored != nil {
		var q []string
		for _, tb := range encTables {
			q = append(q, fmt.Sprintf("SELECT '%[1]s', id, encode(convert_to(payload, 'UTF8'), 'hex'), n FROM %[1]s", tb))
		}
		b.WriteString("SELECT t, string_agg(format('{%s %s n=%s}', id, p, n), '' ORDER BY id) FROM (" +
			strings.Join(q, " UNION ALL ") + ") s(t, id, p, n) GROUP BY t;")
	}
	for _, tb := range encTables {
		fmt.Fprintf(&b, "DELETE FROM %s;", tb)
		if !forInsert {
			fmt.Fprintf(&b, "INSERT INTO %s (id, payload) VALUES (1, 'a');", tb)
		}
	}
	res, err := c.Exec(ctx, b.String()).ReadAll()
	if err != nil {
		t.Fatalf("read and reset: %v", err)
	}
	if stored == nil {
		return
	}
	for _, tb := range encTables {
		stored[tb] = "{}"
	}
	for _, r := range res[0].Rows {
		stored[string(r[0])] = string(r[1])
	}
}
