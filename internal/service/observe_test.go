package service_test

import (
	"context"
	"fmt"
	"net/url"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/service"
)

// observed is a running proxy in a database of its own with one table of
// each kind the metrics and the status page describe: row fencing
// (obs_row), audit mode (obs_audit) and lock fencing (obs_lock), with
// fenceproxy setup done there.
type observed struct {
	in   *service.Instance
	db   string
	path string
}

var observedDBs atomic.Int32

func startObserved(t *testing.T) *observed {
	t.Helper()
	ctx := context.Background()
	db := fmt.Sprintf("observe_%d", observedDBs.Add(1))
	if err := cluster.Exec(ctx, "DROP DATABASE IF EXISTS "+db); err != nil {
		t.Fatal(err)
	}
	if err := cluster.Exec(ctx, "CREATE DATABASE "+db); err != nil {
		t.Fatal(err)
	}
	d, err := pgx.Connect(ctx, cluster.SuperuserDSN(db))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close(ctx)
	for _, tb := range []string{"obs_row", "obs_audit", "obs_lock"} {
		if _, err := d.Exec(ctx, fmt.Sprintf(`CREATE TABLE %[1]s (id int PRIMARY KEY, v text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0);
			INSERT INTO %[1]s (id) SELECT g FROM generate_series(1, 10) g`, tb)); err != nil {
			t.Fatal(err)
		}
	}
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	writeFile(t, path, fmt.Sprintf(`listen: 127.0.0.1:0
upstream:
  address: %s
admin:
  listen: 127.0.0.1:0
tables:
  - table: public.obs_row
  - table: public.obs_audit
    mode: audit
  - table: public.obs_lock
    lock: optional
`, cluster.Addr()))
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	specs, err := rules.Specs(cfg.RulesConfig())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dbsetup.Setup(ctx, d, specs, dbsetup.SetupOptions{Tables: cfg.Tables}); err != nil {
		t.Fatal(err)
	}
	in, _ := startInstance(t, path)
	return &observed{in: in, db: db, path: path}
}

// connect opens a session in the observed database with the given fence
// settings ("" for none).
func (o *observed) connect(t *testing.T, token, lock string) *pgx.Conn {
	t.Helper()
	opts := ""
	if token != "" {
		opts += "-c fence.token=" + token
	}
	if lock != "" {
		opts += " -c fence.lock=" + lock
	}
	dsn := "postgres://postgres@" + o.in.Addr() + "/" + o.db + "?sslmode=disable&application_name=observe"
	if opts != "" {
		dsn += "&options=" + strings.ReplaceAll(url.QueryEscape(opts), "+", "%20")
	}
	c, err := pgx.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

// execState runs sql in c and checks its SQLSTATE ("" for success).
func execState(t *testing.T, c *pgx.Conn, sql, want string) {
	t.Helper()
	_, err := c.Exec(context.Background(), sql)
	if got := sqlstate(err); got != want || (want == "" && err != nil) {
		t.Fatalf("%s: %v, want SQLSTATE %q", sql, err, want)
	}
}

// staleRowWrite has a holder of token 44 write row id of obs_row, then a
// holder of 42 try: refused with FP001.
func (o *observed) staleRowWrite(t *testing.T, id int) {
	t.Helper()
	execState(t, o.connect(t, "44", ""), fmt.Sprintf("UPDATE obs_row SET v = 'new' WHERE id = %d", id), "")
	execState(t, o.connect(t, "42", ""), fmt.Sprintf("UPDATE obs_row SET v = 'old' WHERE id = %d", id), rules.CodeStaleToken)
}

// traffic makes every kind of event the metrics count: fenced writes, a
// stale row write, a write without a token, an audit-mode stale write, a
// stale lock holder, a refused TRUNCATE.
func (o *observed) traffic(t *testing.T) {
	t.Helper()
	o.staleRowWrite(t, 1)
	execState(t, o.connect(t, "", ""), "UPDATE obs_row SET v = 'x' WHERE id = 2", rules.CodeMissingToken)
	execState(t, o.connect(t, "44", ""), "UPDATE obs_audit SET v = 'new' WHERE id = 1", "")
	execState(t, o.connect(t, "42", ""), "UPDATE obs_audit SET v = 'old' WHERE id = 1", "")
	execState(t, o.connect(t, "7", "job/7"), "UPDATE obs_lock SET v = 'new' WHERE id = 1", "")
	execState(t, o.connect(t, "6", "job/7"), "UPDATE obs_lock SET v = 'old' WHERE id = 2", rules.CodeStaleToken)
	execState(t, o.connect(t, "44", ""), "TRUNCATE obs_row", rules.CodeRefused)
	waitFor(t, func() bool {
		return metric(t, o.in, `fenceproxy_audit_would_reject_total{reason="stale",table="public.obs_audit"}`) == 1
	})
}
