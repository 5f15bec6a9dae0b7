package main

import (
	"fmt"
	"io"
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// rewriteMain implements `fenceproxy rewrite -c FILE [SQL | -]`: it prints
// the SQL the proxy would send for SQL, "-- forwarded unchanged", or the
// refusal with its SQLSTATE (exit status 3). With no SQL argument, or "-",
// the SQL is read from standard input.
func rewriteMain(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	c := newCommand("rewrite", "rewrite [--config FILE] [--database D --user U --application-name A] [--server-functions] [--prepared] [SQL | -]", stdout, stderr)
	path := c.configFlag("fenceproxy.yaml", "config file (only its rules are read: token_setting, tables, max_check_bytes)")
	database := c.fs.String("database", "", "session database, for scoped rules")
	user := c.fs.String("user", "", "session user, for scoped rules")
	app := c.fs.String("application-name", "", "session application_name, for scoped rules")
	raisers := c.fs.Bool("server-functions", false, "print the form used in databases where fenceproxy setup installed the error raisers (objects of version 3 or later)")
	prepared := c.fs.Bool("prepared", false, "print the form a client's prepared statement (a Parse) gets: the token as its last parameter where the statement has a token form, else the form reading the setting that is cheaper to execute and dearer to analyse")
	if code, ok := c.parse(args); !ok {
		return code
	}
	fs := c.fs
	var sql string
	switch rest := fs.Args(); {
	case len(rest) == 0 || (len(rest) == 1 && rest[0] == "-"):
		b, err := io.ReadAll(stdin)
		if err != nil {
			fmt.Fprintf(stderr, "fenceproxy rewrite: %v\n", err)
			return 1
		}
		sql = string(b)
	default:
		sql = strings.Join(rest, " ")
	}
	cfg, err := config.LoadRules(*path)
	if err != nil {
		fmt.Fprintf(stderr, "fenceproxy rewrite: %v\n", err)
		return 1
	}
	rs, err := cfg.Rules()
	if err != nil {
		fmt.Fprintf(stderr, "fenceproxy rewrite: %v\n", err)
		return 1
	}
	rs = rs.ForSession(*database, *user, *app)
	if *raisers {
		rs = rs.ServerFunctions()
	}
	d, param := rs.Decide(sql), 0
	if *prepared {
		if text, k, ok := paramForm(d); ok {
			d.SQL, param = text, k
		} else {
			d = rs.Prepared().Decide(sql)
		}
	}
	switch d.Action {
	case rules.Forward:
		fmt.Fprintln(stdout, "-- forwarded unchanged")
		if d.AuditRefusal != nil {
			fmt.Fprintf(stdout, "-- audit: enforce would refuse it: ERROR %s: %s\n", d.AuditRefusal.Code, d.AuditRefusal.Message)
		}
		fmt.Fprintln(stdout, strings.TrimSpace(sql))
	case rules.Rewrite:
		fmt.Fprintf(stdout, "-- rewritten (protected: %s)\n", strings.Join(d.Tables, ", "))
		fmt.Fprintln(stdout, d.SQL)
		if param > 0 {
			fmt.Fprintf(stdout, "-- $%d: the session's token, bound by the proxy at each Bind\n", param)
		}
	}
	if d.Lock != nil {
		when := "in sessions that name a lock"
		if d.Lock.Required {
			when = "always (lock: required)"
		}
		if *prepared && d.Lock.Call != "" {
			fmt.Fprintf(stdout, "-- lock registration, %s: sent before each Bind as\n%s\n", when, d.Lock.Call)
		} else {
			fmt.Fprintf(stdout, "-- lock registration, %s: sent as\n%s\n", when, d.Lock.Query)
		}
	}
	switch d.Action {
	case rules.Refuse:
		fmt.Fprintf(stdout, "-- refused: ERROR %s: %s\n", d.Err.Code, d.Err.Message)
		if d.Err.Detail != "" {
			fmt.Fprintf(stdout, "-- DETAIL: %s\n", d.Err.Detail)
		}
		if d.Err.Hint != "" {
			fmt.Fprintf(stdout, "-- HINT: %s\n", d.Err.Hint)
		}
		return 3
	}
	return 0
}

// paramForm returns d's parameter form for a Parse declaring no types:
// the text, and the token's parameter number.
func paramForm(d rules.Decision) (string, int, bool) {
	if d.Action != rules.Rewrite || d.Tok == nil {
		return "", 0, false
	}
	return d.Tok.ParamText(0)
}
