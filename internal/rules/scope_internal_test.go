package rules

import (
	"fmt"
	"testing"
)

func TestSessionSetsBounded(t *testing.T) {
	// Table i is fenced for user u<k> when bit i of k is set.
	const bits = 10
	var tables []Table
	for i := range bits {
		var users []string
		for k := range 1 << bits {
			if k&(1<<i) != 0 {
				users = append(users, fmt.Sprintf("u%d", k))
			}
		}
		tables = append(tables, Table{Table: fmt.Sprintf("public.t%d", i), Scope: Scope{Users: users}})
	}
	r, err := Compile(Config{Tables: tables})
	if err != nil {
		t.Fatal(err)
	}
	for k := range 1 << bits {
		r.ForSession("db", fmt.Sprintf("u%d", k), "")
	}
	if n := r.sessionSets(); n != maxSessionSets {
		t.Errorf("%d session sets kept, want %d", n, maxSessionSets)
	}
}

func TestScopeCovers(t *testing.T) {
	mk := func(db, users, apps []string) scope {
		s, err := compileScope("s", Scope{Databases: db, Users: users, ApplicationNames: apps})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	any := mk(nil, nil, nil)
	a := mk(nil, []string{"u1", "u2"}, nil)
	b := mk([]string{"d"}, []string{"u2"}, nil)
	c := mk(nil, nil, []string{"x"})
	tests := []struct {
		s, o *scope
		want bool
	}{
		{&any, &a, true}, {&a, &any, false}, {&a, &b, true}, {&b, &a, false},
		{&a, &c, false}, {&c, &a, false}, {&any, &any, true}, {&b, &b, true},
	}
	for i, tt := range tests {
		if got := tt.s.covers(tt.o); got != tt.want {
			t.Errorf("%d: covers = %v, want %v", i, got, tt.want)
		}
	}
}
