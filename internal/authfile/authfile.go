// Package authfile reads PgBouncer-style auth files: one user a line, as
// "user" "password", both double-quoted, a double quote inside written
// twice; other lines (comments, blank) are skipped and fields after the
// second are ignored, as PgBouncer does. fenceproxy logs in to the server
// with these passwords for clients it authenticated by certificate, so a
// line must hold the password itself or, for servers using md5, the md5
// hash PostgreSQL stores ("md5" and 32 hex digits). A SCRAM secret is
// refused: it lets a server check a password, not a client prove one.
package authfile

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
)

// Load reads the auth file at path. Errors name the line, never a
// password.
func Load(path string) (map[string]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return Parse(f)
}

// Parse reads an auth file: a password by user.
func Parse(r io.Reader) (map[string]string, error) {
	out := make(map[string]string)
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if !strings.HasPrefix(line, `"`) {
			continue
		}
		user, rest, err := quoted(line)
		if err != nil {
			return nil, fmt.Errorf("line %d: user name: %w", n, err)
		}
		password, _, err := quoted(strings.TrimLeft(rest, " \t"))
		if err != nil {
			return nil, fmt.Errorf("line %d (user %q): password: %w", n, user, err)
		}
		if strings.HasPrefix(password, "SCRAM-SHA-256$") {
			return nil, fmt.Errorf("line %d (user %q): a SCRAM secret cannot log in to the server; give the password", n, user)
		}
		if _, dup := out[user]; dup {
			return nil, fmt.Errorf("line %d: user %q is listed twice", n, user)
		}
		out[user] = password
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return out, nil
}

// quoted reads a double-quoted field at the start of s ("" inside stands
// for one quote) and returns it and what follows.
func quoted(s string) (field, rest string, err error) {
	if !strings.HasPrefix(s, `"`) {
		return "", "", errors.New("not double-quoted")
	}
	var b strings.Builder
	for i := 1; i < len(s); i++ {
		if s[i] != '"' {
			b.WriteByte(s[i])
			continue
		}
		if i+1 < len(s) && s[i+1] == '"' {
			b.WriteByte('"')
			i++
			continue
		}
		return b.String(), s[i+1:], nil
	}
	return "", "", errors.New("no closing double quote")
}
