package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// URL returns a connection URL for the cluster with sslmode=disable; callers
// may change its query (e.g. sslmode=verify-full) before use. An empty user
// or password is left out.
func (c *Cluster) URL(user, password, database string) *url.URL {
	u := &url.URL{
		Scheme:   "postgres",
		Host:     c.Addr(),
		Path:     "/" + database,
		RawQuery: url.Values{"sslmode": {"disable"}}.Encode(),
	}
	switch {
	case user != "" && password != "":
		u.User = url.UserPassword(user, password)
	case user != "":
		u.User = url.User(user)
	}
	return u
}

// DSN returns URL(user, password, database) as a string. It contains the
// password: do not log it.
func (c *Cluster) DSN(user, password, database string) string {
	return c.URL(user, password, database).String()
}

// SuperuserDSN returns a DSN for the superuser "postgres", which pg_hba.conf
// trusts over TCP from 127.0.0.1.
func (c *Cluster) SuperuserDSN(database string) string {
	return c.DSN(superuser, "", database)
}

// Exec runs sql as the superuser in database "postgres". It uses the simple
// query protocol, so sql may hold several statements; they run in one
// implicit transaction unless sql has its own BEGIN/COMMIT.
func (c *Cluster) Exec(ctx context.Context, sql string) error {
	return c.ExecDB(ctx, "postgres", sql)
}

// ExecDB is Exec in database db.
func (c *Cluster) ExecDB(ctx context.Context, db, sql string) error {
	conn, err := pgconn.Connect(ctx, c.SuperuserDSN(db))
	if err != nil {
		return fmt.Errorf("pgcluster: connect to %q as superuser: %w", db, err)
	}
	_, err = conn.Exec(ctx, sql).ReadAll()
	if closeErr := conn.Close(ctx); err == nil && closeErr != nil {
		return fmt.Errorf("pgcluster: close: %w", closeErr)
	}
	if err != nil {
		// The SQL is not quoted here: it may carry a password.
		return fmt.Errorf("pgcluster: exec in %q: %w", db, err)
	}
	return nil
}

// CreateDatabase creates database name, owned by the superuser.
func (c *Cluster) CreateDatabase(ctx context.Context, name string) error {
	q, err := quoteIdent(name)
	if err != nil {
		return err
	}
	return c.Exec(ctx, "CREATE DATABASE "+q)
}

// CreateUser creates a login role with password, stored so that the
// cluster's AuthMethod really exercises that method: as an MD5 hash for
// "md5" (a SCRAM verifier would make the server switch to SCRAM, see
// https://www.postgresql.org/docs/current/auth-password.html), as a SCRAM
// verifier otherwise. An empty password creates a role without one.
func (c *Cluster) CreateUser(ctx context.Context, name, password string) error {
	encryption := "scram-sha-256"
	if c.authMethod == "md5" {
		encryption = "md5"
	}
	return c.CreateUserWith(ctx, name, password, encryption)
}

// CreateUserWith is CreateUser with the password stored as encryption says:
// "md5" or "scram-sha-256" (the values of password_encryption).
func (c *Cluster) CreateUserWith(ctx context.Context, name, password, encryption string) error {
	if encryption != "md5" && encryption != "scram-sha-256" {
		return fmt.Errorf("pgcluster: password encryption %q, want md5 or scram-sha-256", encryption)
	}
	ident, err := quoteIdent(name)
	if err != nil {
		return err
	}
	if password == "" {
		return c.Exec(ctx, "CREATE ROLE "+ident+" LOGIN")
	}
	lit, err := quoteLiteral(password)
	if err != nil {
		return err
	}
	// The server hashes the password as password_encryption says at the time
	// of CREATE ROLE; SET lasts for this one session.
	return c.Exec(ctx, "SET password_encryption = '"+encryption+"'; CREATE ROLE "+ident+" LOGIN PASSWORD "+lit)
}

var errNUL = errors.New("pgcluster: NUL byte in SQL name or value")

// quoteIdent quotes an SQL identifier.
func quoteIdent(s string) (string, error) {
	if strings.ContainsRune(s, 0) {
		return "", errNUL
	}
	return sqllex.QuoteIdent(s), nil
}

// quoteLiteral quotes an SQL string constant like the server's
// quote_literal: a value with a backslash becomes an E'...' string, which reads
// the same whatever standard_conforming_strings is.
func quoteLiteral(s string) (string, error) {
	if strings.ContainsRune(s, 0) {
		return "", errNUL
	}
	return sqllex.QuoteLiteral(s), nil
}
