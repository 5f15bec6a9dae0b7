package rules_test

import (
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

func TestDropDatabaseRefusal(t *testing.T) {
	scoped, err := rules.Compile(rules.Config{Tables: []rules.Table{{Table: "public.config", Scope: rules.Scope{Databases: []string{"app"}}}}})
	if err != nil {
		t.Fatal(err)
	}
	unscoped, err := rules.Compile(rules.Config{Tables: []rules.Table{{Table: "public.config"}}})
	if err != nil {
		t.Fatal(err)
	}
	// A session in database other: the scoped rules do not fence it, the
	// unscoped ones do (their refusal is Decide's).
	s := rules.Session{Database: "other", User: "u"}
	for _, c := range []struct {
		rs   *rules.Rules
		sql  string
		want bool
	}{
		{scoped, "DROP DATABASE app", true},
		{scoped, `drop database if exists "app" with (force)`, true},
		{scoped, "SELECT 1; DROP DATABASE app", true},
		{scoped, "DROP DATABASE other", false},
		{scoped, "SELECT 'drop database app'", false},
		{unscoped, "DROP DATABASE anything", true},
		{unscoped, "CREATE DATABASE x", false},
	} {
		d, _, _ := c.rs.DecideFor(s, c.sql)
		got := d.Err
		if (d.Action == rules.Refuse) != c.want {
			t.Errorf("%q: refusal %v, want %v", c.sql, got, c.want)
		}
		if got != nil && got.Code != rules.CodeRefused {
			t.Errorf("%q: code %s", c.sql, got.Code)
		}
	}
}
