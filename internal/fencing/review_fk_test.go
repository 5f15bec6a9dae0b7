package fencing_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Adversarial review of f3db390 and 51d85c0: a write of a protected table
// whose foreign key action (ON DELETE / ON UPDATE CASCADE, SET NULL, SET
// DEFAULT) or TRUNCATE ... CASCADE writes a row-fenced protected table is
// refused (FP003); an ON UPDATE action counts only for an UPDATE (or
// upsert) that sets a column of the referenced key, unless the referenced
// table has a BEFORE UPDATE row trigger. Every case reads the tables back
// on a direct connection: the holder of token 5 must not change the
// items, whose rows carry fence 9 (a newer holder wrote them).

// fkRowRules: orders and items, both row-fenced (last_fence).
var fkRowRules = rules.Config{Tables: []rules.Table{{Table: "public.orders"}, {Table: "public.items"}}}

// fkBase: items follow their order's id (ON UPDATE CASCADE) and go with
// it (ON DELETE CASCADE); the items carry fence 9.
const fkBase = `
CREATE TABLE orders (id bigint PRIMARY KEY, code text UNIQUE, note text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint REFERENCES orders ON UPDATE CASCADE ON DELETE CASCADE,
	last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO orders (id, code) VALUES (1, 'a'), (2, 'b'), (3, 'c');
INSERT INTO items (id, order_id, last_fence) VALUES (10, 1, 9), (20, 2, 9);
`

// fkProxy starts a proxy enforcing cfg with a catalog checker of its own,
// its options edited by edit.
func fkProxy(t *testing.T, cfg rules.Config, edit ...func(*proxy.Options)) (*proxytest.Proxy, []rules.TableSpec) {
	t.Helper()
	checker, specs := startChecker(t, cfg)
	rs, err := rules.Compile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return startProxy(t, policy.New(rs, false, policy.Options{Checks: checker}), edit...), specs
}

// fkDB creates a database with schema, runs setup (with the catalog
// watch: the direct connection is a superuser's) and returns its name and
// a direct connection.
func fkDB(t *testing.T, specs []rules.TableSpec, schema string) (string, *pgx.Conn) {
	t.Helper()
	db := schemaDB(t, "rvfk", schema)
	d := direct(t, db)
	if _, err := dbsetup.Setup(ctxT(t), d, specs, dbsetup.SetupOptions{}); err != nil {
		t.Fatal(err)
	}
	return db, d
}

// fkExec runs sql on c, again while the catalog moved (rvRuleTry).
func fkExec(t *testing.T, c *pgx.Conn, sql string, args ...any) error {
	t.Helper()
	return rvRuleTry(func() error {
		_, err := c.Exec(ctxT(t), sql, args...)
		return err
	})
}

// fkRefused reports whether err is a refusal by the paths (FP003, not the
// catalog's move).
func fkRefused(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == rules.CodeRefused && !rvCatalogMoved(err)
}

// fkRows is a table's rows, id:a:b... by id, read on d.
func fkRows(t *testing.T, d *pgx.Conn, q string) string {
	t.Helper()
	var s string
	if err := d.QueryRow(ctxT(t), "SELECT coalesce(string_agg(r, ',' ORDER BY k), '') FROM ("+q+") x(k, r)").Scan(&s); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return s
}

const (
	fkItemsQ  = "SELECT id, id || ':' || coalesce(order_id::text, 'null') || ':' || last_fence FROM items"
	fkOrdersQ = "SELECT id, id || ':' || coalesce(code, '') || ':' || note || ':' || last_fence FROM orders"
)

// fkSimple is a session like rvSession in the simple protocol.
func fkSimple(t *testing.T, p *proxytest.Proxy, db, lk, tok string) *pgx.Conn {
	t.Helper()
	return connectDSN(t, p.DSN("postgres", "", db), func(c *pgx.ConnConfig) {
		c.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
		if lk != "" {
			c.RuntimeParams["fence.lock"] = lk
		}
		if tok != "" {
			c.RuntimeParams["fence.token"] = tok
		}
	})
}

// TestReviewFKUpdateSpellings: every spelling of an UPDATE (or upsert,
// MERGE) of orders that sets its key, whose ON UPDATE CASCADE would
// rewrite items a newer holder wrote, is refused (FP003) in both
// protocols, or fails in PostgreSQL itself; the items and the orders are
// unchanged afterwards. Holds.
func TestReviewFKUpdateSpellings(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := fkProxy(t, fkRowRules)
	db, d := fkDB(t, specs, fkBase)
	items0, orders0 := fkRows(t, d, fkItemsQ), fkRows(t, d, fkOrdersQ)
	conns := map[string]*pgx.Conn{
		"extended": rvSession(t, p, db, "", "5"),
		"simple":   fkSimple(t, p, db, "", "5"),
	}
	for _, q := range []string{
		`UPDATE orders SET id = 7 WHERE id = 2`,
		`UPDATE orders SET "id" = 7 WHERE id = 2`,
		`UPDATE orders SET ID = 7 WHERE id = 2`,
		`UPDATE orders SET "i""d" = 7 WHERE id = 2`, // no such column: PostgreSQL's error
		`UPDATE orders SET U&"\0069d" = 7 WHERE id = 2`,
		`UPDATE public.orders SET id = id + 5 WHERE id = 2`,
		`UPDATE ONLY "public"."orders" SET id = 7 WHERE id = 2`,
		`UPDATE orders AS o SET note = 'x', id = 7 WHERE o.id = 2`,
		`UPDATE orders o SET id = v.n FROM (VALUES (2, 7)) v(o, n) WHERE o.id = v.o`,
		`UPDATE orders SET (note, id) = (SELECT 'x', 7) WHERE id = 2`,
		`UPDATE orders SET (id) = ROW(7) WHERE id = 2`,
		`UPDATE orders SET (note, id) = ('x', DEFAULT) WHERE id = 2`,
		`UPDATE orders SET orders.id = 7 WHERE id = 2`, // PostgreSQL: SET targets cannot be qualified
		`WITH u AS (UPDATE orders SET id = 7 WHERE id = 2 RETURNING 1) SELECT count(*) FROM u`,
		`WITH s AS (SELECT 2 AS o) UPDATE orders SET id = 7 FROM s WHERE id = s.o`,
		`SELECT 1 FROM (SELECT 1) x WHERE EXISTS (SELECT 1) ; UPDATE orders SET id = 7 WHERE id = 2`,
		`INSERT INTO orders (id, code) VALUES (2, 'b') ON CONFLICT (id) DO UPDATE SET id = excluded.id + 5`,
		`INSERT INTO orders AS o (id, code) VALUES (2, 'b') ON CONFLICT ON CONSTRAINT orders_pkey DO UPDATE SET (id) = ROW(o.id + 5)`,
		`WITH x AS (INSERT INTO orders (id, code) VALUES (2, 'b') ON CONFLICT (id) DO UPDATE SET id = 7 RETURNING 1) SELECT count(*) FROM x`,
		`MERGE INTO orders o USING (VALUES (2)) v(id) ON o.id = v.id WHEN MATCHED THEN UPDATE SET id = 7`,
		`MERGE INTO orders o USING (VALUES (2)) v(id) ON o.id = v.id WHEN MATCHED THEN DELETE`,
		`DELETE FROM orders WHERE id = 2`,
		`WITH x AS (DELETE FROM orders WHERE id = 2 RETURNING 1) SELECT count(*) FROM x`,
		`TRUNCATE orders CASCADE`,
		`TRUNCATE orders, items`,
	} {
		for name, c := range conns {
			if name == "extended" && strings.Contains(q, " ; ") {
				continue // one statement per Parse
			}
			err := fkExec(t, c, q)
			var pe *pgconn.PgError
			if !fkRefused(err) && (!errors.As(err, &pe) || strings.HasPrefix(pe.Code, "FP")) {
				t.Errorf("%s: %s: %v, want FP003 (or PostgreSQL's error)", name, q, err)
			} else if !fkRefused(err) {
				t.Logf("%s: %s: PostgreSQL: %v", name, q, err)
			}
			if got := fkRows(t, d, fkItemsQ); got != items0 {
				t.Fatalf("%s: %s changed items: %s, want %s", name, q, got, items0)
			}
			if got := fkRows(t, d, fkOrdersQ); got != orders0 {
				t.Fatalf("%s: %s changed orders: %s, want %s", name, q, got, orders0)
			}
		}
	}
	// SQL PREPARE ... EXECUTE.
	c := conns["simple"]
	if err := fkExec(t, c, "PREPARE up(bigint, bigint) AS UPDATE orders SET id = $1 WHERE id = $2"); err == nil {
		err = fkExec(t, c, "EXECUTE up(7, 2)")
		if !fkRefused(err) {
			t.Errorf("EXECUTE of a prepared key update: %v, want FP003", err)
		}
	} else if !fkRefused(err) {
		t.Errorf("PREPARE of a key update: %v, want FP003 or success", err)
	}
	if got := fkRows(t, d, fkItemsQ); got != items0 {
		t.Errorf("PREPARE/EXECUTE changed items: %s, want %s", got, items0)
	}
}

// TestReviewFKNoOverRefusal: writes of orders that cannot run a foreign
// key action that writes, and reads, run through the proxy, fenced with
// token 5; the items stay as they were. Holds.
func TestReviewFKNoOverRefusal(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := fkProxy(t, fkRowRules)
	db, d := fkDB(t, specs, fkBase+`
CREATE TABLE notes (id bigint PRIMARY KEY, order_id bigint REFERENCES orders ON DELETE NO ACTION ON UPDATE RESTRICT);
`)
	items0 := fkRows(t, d, fkItemsQ)
	for name, c := range map[string]*pgx.Conn{
		"extended": rvSession(t, p, db, "", "5"),
		"simple":   fkSimple(t, p, db, "", "5"),
	} {
		for _, q := range []string{
			`SELECT * FROM orders`,
			`SELECT * FROM orders FOR UPDATE`,
			`UPDATE orders SET note = 'x' WHERE id = 1`,
			`UPDATE orders SET "note" = 'y', code = code || '' WHERE id = 2`, // code is unique, no foreign key references it
			`UPDATE orders SET (note) = (SELECT 'z') WHERE id = 1`,
			`UPDATE orders o SET note = v.n FROM (VALUES (1, 'w')) v(o, n) WHERE o.id = v.o`,
			`WITH u AS (UPDATE orders SET note = 'c' WHERE id = 1 RETURNING 1) SELECT count(*) FROM u`,
			`INSERT INTO orders (id, code) VALUES (100 + length('` + name + `'), 'x` + name + `')`,
			`INSERT INTO orders (id, code) VALUES (1, 'a') ON CONFLICT (id) DO UPDATE SET note = excluded.code`,
			`INSERT INTO orders (id, code) VALUES (1, 'a') ON CONFLICT DO NOTHING`,
			`COPY (SELECT * FROM orders) TO STDOUT`,
		} {
			if name == "extended" && strings.HasPrefix(q, "COPY") {
				continue
			}
			if err := fkExec(t, c, q); err != nil {
				t.Errorf("%s: %s: %v, want it to run", name, q, err)
			}
		}
	}
	var fences string
	if err := d.QueryRow(ctxT(t), "SELECT string_agg(DISTINCT last_fence::text, ',') FROM orders WHERE id IN (1, 2)").Scan(&fences); err != nil || fences != "5" {
		t.Errorf("orders 1, 2 fences %q, %v; want 5 (written with token 5)", fences, err)
	}
	if got := fkRows(t, d, fkItemsQ); got != items0 {
		t.Errorf("items: %s, want %s", got, items0)
	}
}

// fkCase is a schema and a write of token 5 in it: refused (FP003) with
// the items unchanged, or run.
type fkCase struct {
	name, schema, sql string
	refuse            bool
}

// fkRun runs each case in a database of its own, in the simple and the
// extended protocol (each in a fresh database), and checks the items on
// a direct connection.
func fkRun(t *testing.T, cfg rules.Config, cases []fkCase) {
	t.Helper()
	p, specs := fkProxy(t, cfg)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			for _, proto := range []string{"simple", "extended"} {
				db, d := fkDB(t, specs, tc.schema)
				c := rvSession(t, p, db, "", "5")
				if proto == "simple" {
					c = fkSimple(t, p, db, "", "5")
				}
				items0 := fkRows(t, d, fkItemsQ)
				err := fkExec(t, c, tc.sql)
				items := fkRows(t, d, fkItemsQ)
				switch {
				case tc.refuse && !fkRefused(err):
					t.Errorf("%s: %s: %v, want FP003; items %s, were %s", proto, tc.sql, err, items, items0)
				case tc.refuse && items != items0:
					t.Errorf("%s: %s changed items: %s, were %s", proto, tc.sql, items, items0)
				case !tc.refuse && err != nil:
					t.Errorf("%s: %s: %v, want it to run", proto, tc.sql, err)
				}
			}
		})
	}
}

// TestReviewFKActions: foreign key actions into the row-fenced items
// through an unprotected middle table (DELETE, UPDATE of the key,
// TRUNCATE ... CASCADE), as SET NULL (with a column list too) and SET
// DEFAULT, through a key of two columns of which the UPDATE sets one,
// an upsert and MERGE, are refused with the items unchanged; writes that
// run no action that writes (NO ACTION / RESTRICT keys, an UPDATE of a
// column no key holds, a plain INSERT, the id where the items follow the
// code) run. All hold.
func TestReviewFKActions(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	const orders = `CREATE TABLE orders (id bigint PRIMARY KEY, code text UNIQUE, note text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO orders (id, code) VALUES (1, 'a'), (2, 'b'), (3, 'c');
`
	// mid is not protected; items follow mid's copy of the order's id.
	const chain = orders + `
CREATE TABLE mid (id bigint PRIMARY KEY, order_id bigint UNIQUE REFERENCES orders ON UPDATE CASCADE ON DELETE CASCADE);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint REFERENCES mid (order_id) ON UPDATE CASCADE ON DELETE CASCADE,
	last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO mid VALUES (1, 1), (2, 2);
INSERT INTO items (id, order_id, last_fence) VALUES (10, 1, 9), (20, 2, 9);
`
	setNull := orders + `
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint DEFAULT 3 REFERENCES orders ON UPDATE SET DEFAULT ON DELETE SET NULL,
	last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO items (id, order_id, last_fence) VALUES (10, 1, 9), (20, 2, 9);
`
	setNullCols := orders + `
ALTER TABLE orders ADD UNIQUE (id, code);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint, code text, FOREIGN KEY (order_id, code) REFERENCES orders (id, code) ON DELETE SET NULL (code),
	last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO items (id, order_id, code, last_fence) VALUES (10, 1, 'a', 9), (20, 2, 'b', 9);
`
	noAction := orders + `
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint REFERENCES orders ON UPDATE NO ACTION ON DELETE RESTRICT,
	last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO items (id, order_id, last_fence) VALUES (10, 1, 9), (20, 2, 9);
`
	// items reference orders' code, whose ON UPDATE CASCADE counts for
	// an UPDATE of code, not of id.
	byCode := orders + `
CREATE TABLE items (id bigint PRIMARY KEY, order_id text REFERENCES orders (code) ON UPDATE CASCADE,
	last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO items (id, order_id, last_fence) VALUES (10, 'a', 9), (20, 'b', 9);
`
	// A foreign key of two columns, the second set alone.
	twoCols := orders + `
ALTER TABLE orders ADD UNIQUE (id, code);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint, code text, FOREIGN KEY (order_id, code) REFERENCES orders (id, code) ON UPDATE CASCADE,
	last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO items (id, order_id, code, last_fence) VALUES (10, 1, 'a', 9), (20, 2, 'b', 9);
`
	// A self-reference of orders besides: the action on orders itself.
	fkRun(t, fkRowRules, []fkCase{
		{name: "chain delete", schema: chain, sql: "DELETE FROM orders WHERE id = 1", refuse: true},
		{name: "chain update key", schema: chain, sql: "UPDATE orders SET id = 7 WHERE id = 1", refuse: true},
		{name: "chain update other", schema: chain, sql: "UPDATE orders SET note = 'x' WHERE id = 1"},
		{name: "chain truncate cascade", schema: chain, sql: "TRUNCATE orders CASCADE", refuse: true},
		{name: "chain insert", schema: chain, sql: "INSERT INTO orders (id) VALUES (9)"},
		{name: "set null delete", schema: setNull, sql: "DELETE FROM orders WHERE id = 1", refuse: true},
		{name: "set default update", schema: setNull, sql: "UPDATE orders SET id = 8 WHERE id = 1", refuse: true},
		{name: "set default update other", schema: setNull, sql: "UPDATE orders SET note = 'x' WHERE id = 1"},
		{name: "set null column list", schema: setNullCols, sql: "DELETE FROM orders WHERE id = 1", refuse: true},
		{name: "no action delete", schema: noAction, sql: "DELETE FROM orders WHERE id = 3"},
		{name: "no action update", schema: noAction, sql: "UPDATE orders SET id = 8 WHERE id = 3"},
		{name: "by code update code", schema: byCode, sql: "UPDATE orders SET code = 'z' WHERE id = 1", refuse: true},
		{name: "by code update id", schema: byCode, sql: "UPDATE orders SET id = 8 WHERE id = 1"},
		{name: "by code delete", schema: byCode, sql: "DELETE FROM orders WHERE id = 3"},
		{name: "two columns, second set", schema: twoCols, sql: "UPDATE orders SET code = 'z' WHERE id = 1", refuse: true},
		{name: "two columns, first set by upsert", schema: twoCols,
			sql: "INSERT INTO orders (id, code) VALUES (1, 'a') ON CONFLICT (id) DO UPDATE SET id = 8", refuse: true},
		{name: "two columns, merge", schema: twoCols,
			sql: "MERGE INTO orders o USING (VALUES (1)) v(id) ON o.id = v.id WHEN MATCHED THEN UPDATE SET note = 'x'", refuse: true},
	})
}

// TestReviewFKHierarchy: orders is a partitioned or inheritance parent.
// Where the items reference the partitioned orders, its DELETE, its
// UPDATE of the key (moving the row across partitions), the same through
// a partition or a view over orders are refused, and an UPDATE of no key
// runs. Where the items reference a partition or an inheritance child,
// the parent's DELETE and UPDATE of the key are refused (the action runs
// from the descendant's rows the parent's write reaches), and so is an
// UPDATE of no key of the parent where a partition alone has a BEFORE
// UPDATE trigger that changes the key.
func TestReviewFKHierarchy(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	const items = `
INSERT INTO items (id, order_id, last_fence) VALUES (10, 1, 9), (20, 2, 9);
`
	inherit := `
CREATE TABLE orders (id bigint PRIMARY KEY, note text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0);
CREATE TABLE orders_old (PRIMARY KEY (id)) INHERITS (orders);
INSERT INTO orders_old (id) VALUES (1), (2), (3);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint REFERENCES orders_old ON UPDATE CASCADE ON DELETE CASCADE,
	last_fence bigint NOT NULL DEFAULT 0);
` + items
	partOnly := `
CREATE TABLE orders (id bigint, region int NOT NULL DEFAULT 1, note text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0,
	PRIMARY KEY (id, region)) PARTITION BY LIST (region);
CREATE TABLE orders_1 PARTITION OF orders FOR VALUES IN (1);
ALTER TABLE orders_1 ADD UNIQUE (id);
INSERT INTO orders (id) VALUES (1), (2), (3);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint REFERENCES orders_1 (id) ON UPDATE CASCADE ON DELETE CASCADE,
	last_fence bigint NOT NULL DEFAULT 0);
` + items
	// items reference the partitioned orders; a BEFORE UPDATE trigger of
	// the partition alone moves the key of an order whose note is 'move'.
	partTrigger := `
CREATE TABLE orders (id bigint PRIMARY KEY, note text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0) PARTITION BY RANGE (id);
CREATE TABLE orders_1 PARTITION OF orders FOR VALUES FROM (0) TO (1000);
INSERT INTO orders (id) VALUES (1), (2), (3);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint REFERENCES orders ON UPDATE CASCADE ON DELETE CASCADE,
	last_fence bigint NOT NULL DEFAULT 0);
CREATE FUNCTION move() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN IF NEW.note = 'move' THEN NEW.id := NEW.id + 100; END IF; RETURN NEW; END $$;
CREATE TRIGGER move BEFORE UPDATE ON orders_1 FOR EACH ROW EXECUTE FUNCTION move();
` + items
	partParent := `
CREATE TABLE orders (id bigint PRIMARY KEY, note text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0) PARTITION BY RANGE (id);
CREATE TABLE orders_1 PARTITION OF orders FOR VALUES FROM (0) TO (1000);
CREATE TABLE orders_2 PARTITION OF orders FOR VALUES FROM (1000) TO (2000);
INSERT INTO orders (id) VALUES (1), (2), (3);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint REFERENCES orders ON UPDATE CASCADE ON DELETE CASCADE,
	last_fence bigint NOT NULL DEFAULT 0);
CREATE VIEW orders_v AS SELECT * FROM orders;
` + items
	fkRun(t, fkRowRules, []fkCase{
		{name: "partitioned parent, delete", schema: partParent, sql: "DELETE FROM orders WHERE id = 1", refuse: true},
		{name: "partitioned parent, key moved across partitions", schema: partParent, sql: "UPDATE orders SET id = 1500 WHERE id = 1", refuse: true},
		{name: "partitioned parent, update other", schema: partParent, sql: "UPDATE orders SET note = 'x' WHERE id = 1"},
		{name: "partition named, delete", schema: partParent, sql: "DELETE FROM orders_1 WHERE id = 1", refuse: true},
		{name: "partition named, update key", schema: partParent, sql: "UPDATE orders_1 SET id = 5 WHERE id = 1", refuse: true},
		{name: "view over the parent", schema: partParent, sql: "UPDATE orders_v SET id = 5 WHERE id = 1", refuse: true},
		{name: "inheritance child referenced, delete of the parent", schema: inherit, sql: "DELETE FROM orders WHERE id = 1", refuse: true},
		{name: "inheritance child referenced, update of the parent's key", schema: inherit, sql: "UPDATE orders SET id = 7 WHERE id = 1", refuse: true},
		{name: "partition referenced, delete of the parent", schema: partOnly, sql: "DELETE FROM orders WHERE id = 1", refuse: true},
		{name: "partition referenced, update of the parent's key", schema: partOnly, sql: "UPDATE orders SET id = 7 WHERE id = 1", refuse: true},
		{name: "before trigger on the partition only", schema: partTrigger, sql: "UPDATE orders SET note = 'move' WHERE id = 1", refuse: true},
	})
}

// TestReviewFKGeneratedKey: the referenced key is a stored generated
// column, which an UPDATE changes by setting the column it is computed
// from: refused, the items unchanged. An UPDATE of an unrelated column
// runs.
func TestReviewFKGeneratedKey(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	gen := `
CREATE TABLE orders (id bigint PRIMARY KEY, ref bigint GENERATED ALWAYS AS (id * 10) STORED UNIQUE,
	note text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO orders (id) VALUES (1), (2), (3);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint REFERENCES orders (ref) ON UPDATE CASCADE,
	last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO items (id, order_id, last_fence) VALUES (10, 10, 9), (20, 20, 9);
`
	fkRun(t, fkRowRules, []fkCase{
		{name: "set the generating column", schema: gen, sql: "UPDATE orders SET id = 7 WHERE id = 1", refuse: true},
		{name: "set another column", schema: gen, sql: "UPDATE orders SET note = 'x' WHERE id = 1"},
	})
}

// TestReviewFKCatalogChanges: a BEFORE UPDATE trigger, a foreign key, a
// renamed key column, created on a direct connection while the proxy
// runs, after the client prepared its statements (pgx's named statements,
// SQL PREPARE, a pipeline): the statements prepared before are decided
// again and refused (after at most a few FP003 "catalog changed"
// retries), the items unchanged; once the trigger or the foreign key is
// dropped they run again. All hold.
func TestReviewFKCatalogChanges(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := fkProxy(t, fkRowRules)
	refused := func(t *testing.T, what string, err error) {
		t.Helper()
		if !fkRefused(err) {
			t.Errorf("%s: %v, want FP003", what, err)
		}
	}
	pipeline := func(c *pgx.Conn, sql string, args ...any) error {
		return rvRuleTry(func() error {
			b := &pgx.Batch{}
			b.Queue("SELECT count(*) FROM orders")
			b.Queue(sql, args...)
			// A context of its own: the subtests wait for their turn
			// after this function returns.
			return c.SendBatch(testutil.Ctx(t), b).Close()
		})
	}

	t.Run("before trigger", func(t *testing.T) {
		t.Parallel()
		db, d := fkDB(t, specs, fkBase)
		c, s := rvSession(t, p, db, "", "5"), fkSimple(t, p, db, "", "5")
		const upd = "UPDATE orders SET note = $1 WHERE id = $2"
		mustExec(t, c, upd, "x", 1)
		mustExec(t, s, "PREPARE upn(text, bigint) AS "+upd)
		mustExec(t, s, "EXECUTE upn('x', 1)")
		if err := pipeline(c, upd, "x", 1); err != nil {
			t.Fatal(err)
		}
		items0 := fkRows(t, d, fkItemsQ)
		execDirect(t, d, `CREATE FUNCTION move() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN IF NEW.note = 'move' THEN NEW.id := NEW.id + 100; END IF; RETURN NEW; END $$;
CREATE TRIGGER move BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION move()`)
		refused(t, "named statement prepared before", fkExec(t, c, upd, "move", 1))
		refused(t, "SQL EXECUTE prepared before", fkExec(t, s, "EXECUTE upn('move', 1)"))
		refused(t, "pipeline", pipeline(c, upd, "move", 1))
		refused(t, "simple", fkExec(t, s, "UPDATE orders SET note = 'move' WHERE id = 1"))
		if got := fkRows(t, d, fkItemsQ); got != items0 {
			t.Errorf("items: %s, were %s", got, items0)
		}
		execDirect(t, d, "DROP TRIGGER move ON orders")
		if err := fkExec(t, c, upd, "move", 1); err != nil {
			t.Errorf("after the trigger's drop: %v, want it to run", err)
		}
		if got := fkRows(t, d, fkItemsQ); got != items0 {
			t.Errorf("items: %s, were %s", got, items0)
		}
	})

	t.Run("foreign key added and dropped", func(t *testing.T) {
		t.Parallel()
		db, d := fkDB(t, specs, `
CREATE TABLE orders (id bigint PRIMARY KEY, code text UNIQUE, note text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint, last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO orders (id) VALUES (1), (2), (3), (4), (5), (6);
INSERT INTO items (id, order_id, last_fence) VALUES (10, 1, 9), (20, 2, 9);
`)
		c, s := rvSession(t, p, db, "", "5"), fkSimple(t, p, db, "", "5")
		const del, upk = "DELETE FROM orders WHERE id = $1", "UPDATE orders SET id = $1 WHERE id = $2"
		mustExec(t, c, del, 3)
		mustExec(t, c, upk, 40, 4)
		mustExec(t, s, "PREPARE del(bigint) AS "+del)
		mustExec(t, s, "EXECUTE del(5)")
		mustExec(t, s, "PREPARE upk(bigint, bigint) AS "+upk)
		mustExec(t, s, "EXECUTE upk(60, 6)")
		items0 := fkRows(t, d, fkItemsQ)
		execDirect(t, d, "ALTER TABLE items ADD CONSTRAINT items_fk FOREIGN KEY (order_id) REFERENCES orders ON DELETE CASCADE ON UPDATE CASCADE")
		refused(t, "named DELETE prepared before", fkExec(t, c, del, 1))
		refused(t, "named UPDATE of the key prepared before", fkExec(t, c, upk, 7, 2))
		refused(t, "SQL EXECUTE of a DELETE prepared before", fkExec(t, s, "EXECUTE del(1)"))
		refused(t, "SQL EXECUTE of an UPDATE prepared before", fkExec(t, s, "EXECUTE upk(7, 2)"))
		refused(t, "pipeline", pipeline(c, del, 2))
		if got := fkRows(t, d, fkItemsQ); got != items0 {
			t.Errorf("items: %s, were %s", got, items0)
		}
		if err := fkExec(t, c, "UPDATE orders SET note = $1 WHERE id = $2", "y", 1); err != nil {
			t.Errorf("UPDATE of no key: %v", err)
		}
		// Dropped: the writes run again, and change no item.
		execDirect(t, d, "ALTER TABLE items DROP CONSTRAINT items_fk")
		if err := fkExec(t, c, del, 1); err != nil {
			t.Errorf("named DELETE after the drop: %v", err)
		}
		if err := fkExec(t, s, "EXECUTE upk(7, 2)"); err != nil {
			t.Errorf("SQL EXECUTE after the drop: %v", err)
		}
		if got := fkRows(t, d, fkItemsQ); got != items0 {
			t.Errorf("items: %s, were %s", got, items0)
		}
	})

	t.Run("key column renamed", func(t *testing.T) {
		t.Parallel()
		db, d := fkDB(t, specs, fkBase)
		c := rvSession(t, p, db, "", "5")
		mustExec(t, c, "UPDATE orders SET code = $1 WHERE id = $2", "q", 3)
		items0 := fkRows(t, d, fkItemsQ)
		// The key the items follow is renamed: the path's columns follow.
		execDirect(t, d, "ALTER TABLE orders RENAME COLUMN id TO oid2")
		refused(t, "UPDATE of the renamed key", fkExec(t, c, "UPDATE orders SET oid2 = $1 WHERE oid2 = $2", 7, 2))
		if got := fkRows(t, d, fkItemsQ); got != items0 {
			t.Errorf("items: %s, were %s", got, items0)
		}
		if err := fkExec(t, c, "UPDATE orders SET code = $1 WHERE oid2 = $2", "r", 3); err != nil {
			t.Errorf("UPDATE of no key: %v", err)
		}
	})
}

// fkLockSchema: lorders and litems, fenced by the lock alone where the
// config says so; litems go with their order.
const fkLockSchema = `
CREATE TABLE lorders (id bigint PRIMARY KEY, note text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0);
CREATE TABLE litems (id bigint PRIMARY KEY, order_id bigint REFERENCES lorders ON DELETE CASCADE ON UPDATE CASCADE);
INSERT INTO lorders (id) VALUES (1), (2), (3);
INSERT INTO litems (id, order_id) VALUES (10, 1), (20, 2);
`

// TestReviewFKLockOnly: the checker's lockCovered. A foreign key action
// from lorders into litems, fenced by the lock alone, runs for the
// lock's current holder where every entry of lorders is lock: required
// (the statement registered the session's lock), and is refused (FP003)
// where lorders is lock: optional. Where a session may be outside every
// entry of lorders that applies (mode off for its application_name, or a
// scope of users), lorders is not fenced for it at all, and the cascade
// into litems would be a write no registration covers: refused.
func TestReviewFKLockOnly(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	litems := func(t *testing.T, d *pgx.Conn) string {
		return fkRows(t, d, "SELECT id, id || ':' || order_id FROM litems")
	}
	legacy := func(t *testing.T, p *proxytest.Proxy, db, app, tok string) *pgx.Conn {
		return connectDSN(t, p.DSN("postgres", "", db), func(c *pgx.ConnConfig) {
			c.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
			c.RuntimeParams["fence.lock"] = "L"
			c.RuntimeParams["fence.token"] = tok
			if app != "" {
				c.RuntimeParams["application_name"] = app
			}
		})
	}
	litemsReq := rules.Table{Table: "public.litems", Lock: rules.LockRequired}

	t.Run("lock required on both", func(t *testing.T) {
		t.Parallel()
		p, specs := fkProxy(t, rules.Config{Tables: []rules.Table{{Table: "public.lorders", Lock: rules.LockRequired}, litemsReq}})
		db, d := fkDB(t, specs, fkLockSchema)
		c := legacy(t, p, db, "", "5")
		if err := fkExec(t, c, "DELETE FROM lorders WHERE id = $1", 1); err != nil {
			t.Fatalf("current holder's delete: %v", err)
		}
		if got := litems(t, d); got != "20:2" {
			t.Errorf("litems %s, want 20:2", got)
		}
		mustExec(t, legacy(t, p, db, "", "9"), "SELECT count(*) FROM lorders")
		if err := fkExec(t, c, "DELETE FROM lorders WHERE id = $1", 2); rvCode(err) != "FP001" {
			t.Errorf("stale holder's delete: %v, want FP001", err)
		}
		if got := litems(t, d); got != "20:2" {
			t.Errorf("litems %s, want 20:2", got)
		}
	})

	t.Run("lock optional on the start", func(t *testing.T) {
		t.Parallel()
		p, specs := fkProxy(t, rules.Config{Tables: []rules.Table{{Table: "public.lorders", Lock: rules.LockOptional}, litemsReq}})
		db, d := fkDB(t, specs, fkLockSchema)
		// A session without a lock writes lorders fenced by rows alone.
		c := rvSession(t, p, db, "", "5")
		if err := fkExec(t, c, "DELETE FROM lorders WHERE id = $1", 1); !fkRefused(err) {
			t.Errorf("delete: %v, want FP003", err)
		}
		if err := fkExec(t, c, "UPDATE lorders SET note = 'x' WHERE id = $1", 1); err != nil {
			t.Errorf("update of no key: %v", err)
		}
		if got := litems(t, d); got != "10:1,20:2" {
			t.Errorf("litems %s, want 10:1,20:2", got)
		}
	})

	// Two entries of lorders: the first, mode off, for the sessions of
	// application "legacy", for which lorders is not fenced: a legacy
	// session with a stale token, refused on litems itself, must not
	// delete litems' rows through lorders.
	t.Run("mode off entry first", func(t *testing.T) {
		t.Parallel()
		p, specs := fkProxy(t, rules.Config{Tables: []rules.Table{
			{Table: "public.lorders", Mode: rules.ModeOff, Scope: rules.Scope{ApplicationNames: []string{"legacy"}}},
			{Table: "public.lorders", Lock: rules.LockRequired},
			litemsReq,
		}})
		fkLockOutOfScope(t, p, specs, legacy, litems, "legacy")
	})
	t.Run("scope of users", func(t *testing.T) {
		t.Parallel()
		p, specs := fkProxy(t, rules.Config{Tables: []rules.Table{
			{Table: "public.lorders", Lock: rules.LockRequired, Scope: rules.Scope{Users: []string{"someone_else"}}},
			litemsReq,
		}})
		fkLockOutOfScope(t, p, specs, legacy, litems, "")
	})
}

// fkLockOutOfScope: a newer holder (9) of lock L reads litems; a session
// of application app with token 5, for which lorders is not fenced, is
// refused on litems, and must not delete litems' rows through lorders.
func fkLockOutOfScope(t *testing.T, p *proxytest.Proxy, specs []rules.TableSpec,
	session func(*testing.T, *proxytest.Proxy, string, string, string) *pgx.Conn,
	litems func(*testing.T, *pgx.Conn) string, app string) {
	t.Helper()
	db, d := fkDB(t, specs, fkLockSchema)
	mustExec(t, session(t, p, db, "", "9"), "SELECT count(*) FROM litems")
	c := session(t, p, db, app, "5")
	if err := fkExec(t, c, "DELETE FROM litems WHERE id = $1", 10); rvCode(err) != "FP001" {
		t.Errorf("stale session's delete of litems: %v, want FP001", err)
	}
	err := fkExec(t, c, "DELETE FROM lorders WHERE id = $1", 1)
	if got := litems(t, d); got != "10:1,20:2" {
		t.Errorf("stale session's delete of lorders (%v) deleted litems through the foreign key: %s, want 10:1,20:2", err, got)
	}
}

// TestReviewFKRulesAndUnprotectedStart: the new ON UPDATE columns also
// apply where the start is an unprotected table (mid, whose key the
// row-fenced items follow), reached directly, by an upsert, or through a
// rule on another unprotected table whose action is an upsert of mid
// (followed as an UPDATE, whatever it sets); an UPDATE or upsert of
// mid's other column and a plain INSERT into it run. All hold.
func TestReviewFKRulesAndUnprotectedStart(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	const mid = `
CREATE TABLE orders (id bigint PRIMARY KEY, note text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0);
CREATE TABLE mid (id bigint PRIMARY KEY, k bigint UNIQUE, note text NOT NULL DEFAULT '');
INSERT INTO mid (id, k) VALUES (1, 1), (2, 2);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint REFERENCES mid (k) ON UPDATE CASCADE, last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO items (id, order_id, last_fence) VALUES (10, 1, 9), (20, 2, 9);
CREATE TABLE t (id bigint, k bigint);
CREATE RULE up AS ON INSERT TO t DO INSTEAD
	INSERT INTO mid (id, k) VALUES (new.id, new.k) ON CONFLICT (id) DO UPDATE SET k = excluded.k;
CREATE TABLE t2 (id bigint, k bigint);
CREATE RULE up AS ON UPDATE TO t2 DO INSTEAD UPDATE orders SET id = new.id WHERE id = old.id;
INSERT INTO orders (id) VALUES (1);
`
	fkRun(t, fkRowRules, []fkCase{
		{name: "update of mid's key", schema: mid, sql: "UPDATE mid SET k = 7 WHERE id = 1", refuse: true},
		{name: "update of mid's key in a CTE", schema: mid, sql: "WITH u AS (UPDATE mid SET (note, k) = ('x', 7) WHERE id = 1 RETURNING 1) SELECT count(*) FROM u", refuse: true},
		{name: "update of mid's note", schema: mid, sql: "UPDATE mid SET note = 'x' WHERE id = 1"},
		{name: "upsert of mid's key", schema: mid, sql: "INSERT INTO mid (id, k) VALUES (1, 7) ON CONFLICT (id) DO UPDATE SET k = excluded.k", refuse: true},
		{name: "upsert of mid's note", schema: mid, sql: "INSERT INTO mid (id, k) VALUES (1, 7) ON CONFLICT (id) DO UPDATE SET note = 'x'"},
		{name: "insert into mid", schema: mid, sql: "INSERT INTO mid (id, k) VALUES (3, 3)"},
		{name: "merge into mid", schema: mid, sql: "MERGE INTO mid m USING (VALUES (1)) v(id) ON m.id = v.id WHEN MATCHED THEN UPDATE SET k = 7", refuse: true},
		{name: "rule whose action upserts mid", schema: mid, sql: "INSERT INTO t VALUES (1, 7)", refuse: true},
		{name: "rule whose action updates orders", schema: mid, sql: "UPDATE t2 SET id = 7", refuse: true},
	})
}
