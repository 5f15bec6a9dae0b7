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
		"SELECT 'a;b'; ":                  false,
		"UPDATE acct SET n = 1; SELECT (": false,
	} {
		if got := frontCheck(sql); got != want {
			t.Errorf("frontCheck(%q) = %v, want %v", sql, got, want)
		}
	}
}
