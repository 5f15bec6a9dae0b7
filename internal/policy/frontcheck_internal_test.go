package policy

import "testing"

// TestFrontCheck: the check goes in front of a text of several
// statements, unless it begins by ending a transaction opened before.
func TestFrontCheck(t *testing.T) {
	for sql, want := range map[string]bool{
		"SELECT 1; DELETE FROM top WHERE id = 1":                                            true,
		"BEGIN; UPDATE acct SET n = 1; COMMIT":                                              true,
		"SAVEPOINT a; UPDATE acct SET n = 1":                                                true,
		"SET LOCAL lock_timeout = 0; DELETE FROM top":                                       true,
		"DELETE FROM top WHERE id = 1":                                                      false,
		"DELETE FROM top WHERE id = 1;  ":                                                   false,
		"DO $$BEGIN UPDATE acct SET n = 1; PERFORM 1; END$$":                                false,
		"COMMIT; UPDATE acct SET n = 1":                                                     false,
		"ROLLBACK TO SAVEPOINT a; UPDATE acct SET n = 1":                                    false,
		"CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; SELECT 2; END": false,
		"SELECT 'a;b'; ": false,
		"BEGIN ISOLATION LEVEL REPEATABLE READ; UPDATE acct SET n = 1; COMMIT":       false,
		"BEGIN; SET TRANSACTION ISOLATION LEVEL SERIALIZABLE; UPDATE acct SET n = 1": false,
		"SET LOCAL transaction_read_only = off; UPDATE acct SET n = 1":               false,
		"START TRANSACTION READ WRITE; UPDATE acct SET n = 1":                        false,
		"UPDATE acct SET n = 1; SELECT (":                                            false,
	} {
		if got := frontCheck(sql); got != want {
			t.Errorf("frontCheck(%q) = %v, want %v", sql, got, want)
		}
	}
}

// TestInBandWrite: the check goes in front of one statement that begins
// with a write's keyword, after comments and empty statements too.
func TestInBandWrite(t *testing.T) {
	for sql, want := range map[string]bool{
		"DELETE FROM top WHERE id = 1":                 true,
		"/* c */ DELETE FROM top WHERE id = 1":         true,
		"-- c\nDELETE FROM top WHERE id = $1":          true,
		"; DELETE FROM top WHERE id = 1;;  -- done":    true,
		"EXPLAIN ANALYZE DELETE FROM top WHERE id = 1": true,
		"DELETE FROM top; DELETE FROM top":             false,
		"/* DELETE */ VACUUM top":                      false,
		"DELETE FROM top WHERE s = ';' AND id = 1":     false,
		"-- c DELETE FROM top":                         false,
		"DO $$BEGIN DELETE FROM top; END$$":            false,
		"/* unterminated DELETE FROM top":              false,
	} {
		if got := inBandWrite(sql); got != want {
			t.Errorf("inBandWrite(%q) = %v, want %v", sql, got, want)
		}
	}
}
