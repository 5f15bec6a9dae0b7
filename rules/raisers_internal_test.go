package rules

import (
	"reflect"
	"testing"
	"unsafe"
)

// TestServerFunctionsCopiesEveryField: the ServerFunctions sibling is r in
// every field but its own (a field added to Rules and forgotten there
// fails here).
func TestServerFunctionsCopiesEveryField(t *testing.T) {
	r, err := Compile(Config{AuditTag: "x", LockSetting: "app.lock", Tables: []Table{
		{Table: "public.config"},
		{Table: "public.jobs", Mode: ModeAudit, Lock: LockRequired},
		{Table: "public.scoped", Scope: Scope{Users: []string{"app"}}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	s := r.ServerFunctions()
	if !s.raisers || r.raisers || s.cacheSet != r.cacheSet|raisersCacheSet || r.ServerFunctions() != s || s.ServerFunctions() != s {
		t.Fatalf("sibling: raisers %v/%v, cacheSet %d/%d", r.raisers, s.raisers, r.cacheSet, s.cacheSet)
	}
	rv, sv := reflect.ValueOf(r).Elem(), reflect.ValueOf(s).Elem()
	for i := 0; i < rv.NumField(); i++ {
		switch name := rv.Type().Field(i).Name; name {
		case "raisers", "cacheSet", "calls", "nCalls", "withRaisers":
			continue
		default:
			a, b := rv.Field(i), sv.Field(i)
			ai := reflect.NewAt(a.Type(), unsafe.Pointer(a.UnsafeAddr())).Elem().Interface()
			bi := reflect.NewAt(b.Type(), unsafe.Pointer(b.UnsafeAddr())).Elem().Interface()
			if !reflect.DeepEqual(ai, bi) {
				t.Errorf("field %s differs in the ServerFunctions sibling", name)
			}
		}
	}
}
