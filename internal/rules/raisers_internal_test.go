package rules

import (
	"reflect"
	"testing"
	"unsafe"
)

// TestServerFunctionsCopiesEveryField: the ServerFunctions sibling, and its
// Prepared sibling, are r in every field but their own (a field added to
// Rules and forgotten there fails here).
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
	p := s.Prepared()
	if !p.raisers || !p.prepared || s.prepared || p.cacheSet != r.cacheSet|raisersCacheSet|preparedCacheSet || s.Prepared() != p || p.Prepared() != p ||
		p.ServerFunctions() != p {
		t.Fatalf("prepared sibling: raisers %v, prepared %v/%v, cacheSet %d", p.raisers, s.prepared, p.prepared, p.cacheSet)
	}
	ip := r.Prepared()
	ips := ip.ServerFunctions()
	if ip.raisers || !ip.prepared || r.prepared || ip.cacheSet != r.cacheSet|preparedCacheSet || r.Prepared() != ip || ip.Prepared() != ip ||
		!ips.raisers || !ips.prepared || ips.cacheSet != p.cacheSet || ips.ServerFunctions() != ips || ips.Prepared() != ips {
		t.Fatalf("inline prepared sibling: raisers %v, prepared %v, cacheSet %d; its ServerFunctions: raisers %v, prepared %v, cacheSet %d",
			ip.raisers, ip.prepared, ip.cacheSet, ips.raisers, ips.prepared, ips.cacheSet)
	}
	for _, sib := range []*Rules{s, p, ip, ips} {
		rv, sv := reflect.ValueOf(r).Elem(), reflect.ValueOf(sib).Elem()
		for i := 0; i < rv.NumField(); i++ {
			switch name := rv.Type().Field(i).Name; name {
			case "raisers", "prepared", "cacheSet", "calls", "nCalls", "withRaisers", "withPrepared":
				continue
			default:
				a, b := rv.Field(i), sv.Field(i)
				ai := reflect.NewAt(a.Type(), unsafe.Pointer(a.UnsafeAddr())).Elem().Interface()
				bi := reflect.NewAt(b.Type(), unsafe.Pointer(b.UnsafeAddr())).Elem().Interface()
				if !reflect.DeepEqual(ai, bi) {
					t.Errorf("field %s differs in a sibling (prepared %v)", name, sib.prepared)
				}
			}
		}
	}
}
