package rules

import (
	"bytes"
	"reflect"
	"sync"
	"testing"

	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// TestFragmentKeyFields: fragmentKey encodes every field of the node types
// it handles; a field added to one of them by a pg_query_go upgrade fails
// here until the encoder handles it.
func TestFragmentKeyFields(t *testing.T) {
	for rt, fields := range map[reflect.Type]int{
		reflect.TypeFor[pg.FuncCall](): 11, reflect.TypeFor[pg.A_Const](): 3, reflect.TypeFor[pg.A_Expr](): 5,
		reflect.TypeFor[pg.TypeCast](): 3, reflect.TypeFor[pg.TypeName](): 8, reflect.TypeFor[pg.CaseExpr](): 7,
		reflect.TypeFor[pg.CaseWhen](): 4, reflect.TypeFor[pg.BoolExpr](): 4, reflect.TypeFor[pg.BooleanTest](): 4,
		reflect.TypeFor[pg.ColumnRef](): 2, reflect.TypeFor[pg.String](): 1, reflect.TypeFor[pg.CoalesceExpr](): 5,
		reflect.TypeFor[pg.Integer](): 1, reflect.TypeFor[pg.Float](): 1, reflect.TypeFor[pg.Boolean](): 1,
		reflect.TypeFor[pg.BitString](): 1,
	} {
		n := 0
		for i := 0; i < rt.NumField(); i++ {
			if rt.Field(i).IsExported() {
				n++
			}
		}
		if n != fields {
			t.Errorf("%s has %d fields, fragmentKey encodes %d", rt.Name(), n, fields)
		}
	}
}

// fenceNodes builds every fence expression of every table rule of a few
// configurations, in both forms.
func fenceNodes(t *testing.T) []*pg.Node {
	t.Helper()
	var out []*pg.Node
	for _, cfg := range []Config{
		{Tables: []Table{{Table: "public.config"}, {Table: `app."Accounts"`, Column: "fence", Strict: true}}},
		{TokenSetting: "app.tok", Tables: []Table{{Table: "public.config", OnStale: "skip"}, {Table: "public.b", MissingToken: "allow"}}},
		{AuditTag: "x", Tables: []Table{{Table: "public.config", Mode: ModeAudit}}},
	} {
		r, err := Compile(cfg)
		if err != nil {
			t.Fatal(err)
		}
		for _, raisers := range []bool{false, true} {
			for _, tr := range r.tables {
				for _, qual := range []string{`we"ird`} {
					f := &fencer{setting: r.tokenSetting, tag: r.auditTag, t: tr, qual: qual, raisers: raisers}
					out = append(out, f.guard(), f.tokenGuard(), f.stamp(true), f.stamp(false),
						f.errorSetValue(true), f.errorSetValue(false), f.auditSetValue(true), f.skipSetValue(true),
						f.skipCond(), f.freshOrRaise(nil), f.freshOrRaise(hole(0)), f.freshOrNotify(hole(1)),
						f.auditCheck(), f.notFresh(aBool(false)), f.raiseStale("int8"), f.raiseToken("bool"))
				}
			}
		}
	}
	return out
}

// mutants returns copies of n that each differ from it in one field: every
// scalar field of every message in it changed, and every list shortened.
func mutants(n *pg.Node) []*pg.Node {
	var out []*pg.Node
	count := 0
	walkMessages(n.ProtoReflect(), func(protoreflect.Message) bool { count++; return true })
	for k := 0; k < count; k++ {
		for f := 0; ; f++ {
			c := proto.Clone(n).(*pg.Node)
			i, done, changed := 0, false, false
			walkMessages(c.ProtoReflect(), func(m protoreflect.Message) bool {
				if i++; i-1 != k || done {
					return !done
				}
				fields := m.Descriptor().Fields()
				if f >= fields.Len() {
					done = true
					return false
				}
				fd := fields.Get(f)
				if fd.ContainingOneof() != nil && !m.Has(fd) {
					return false // setting it would switch the oneof
				}
				v := m.Get(fd)
				switch {
				case fd.IsList():
					if l := m.Mutable(fd).List(); l.Len() > 0 {
						l.Truncate(l.Len() - 1)
						changed = true
					}
				case fd.Message() != nil || fd.IsMap():
				case fd.Kind() == protoreflect.BoolKind:
					m.Set(fd, protoreflect.ValueOfBool(!v.Bool()))
					changed = true
				case fd.Kind() == protoreflect.StringKind:
					m.Set(fd, protoreflect.ValueOfString(v.String()+"x"))
					changed = true
				case fd.Kind() == protoreflect.EnumKind:
					m.Set(fd, protoreflect.ValueOfEnum(v.Enum()+1))
					changed = true
				case fd.Kind() == protoreflect.Int32Kind:
					m.Set(fd, protoreflect.ValueOfInt32(int32(v.Int())+1))
					changed = true
				case fd.Kind() == protoreflect.Uint32Kind:
					m.Set(fd, protoreflect.ValueOfUint32(uint32(v.Uint())+1))
					changed = true
				}
				done = true
				return false
			})
			if i <= k || (done && !changed && f >= 64) {
				break
			}
			if changed {
				out = append(out, c)
			}
			if done && !changed {
				continue
			}
			if !done {
				break
			}
		}
	}
	return out
}

// TestFragmentKeyExact: over every fence expression and every one-field
// change of each, two nodes get the same fragmentKey exactly when their
// protobuf encodings are the same.
func TestFragmentKeyExact(t *testing.T) {
	if testing.Short() {
		t.Skip("slow (about 30 s): every one-field change of every fence expression; runs without -short")
	}
	// Distinct expressions only, and mutants of those the encoder handles
	// (the others are keyed by protobuf anyway).
	var nodes []*pg.Node
	seen := map[string]bool{}
	for _, n := range fenceNodes(t) {
		p, err := proto.MarshalOptions{Deterministic: true}.Marshal(n)
		if err != nil {
			t.Fatal(err)
		}
		if seen[string(p)] {
			continue
		}
		seen[string(p)] = true
		nodes = append(nodes, n)
	}
	var wg sync.WaitGroup
	muts := make([][]*pg.Node, len(nodes))
	for i, n := range nodes {
		if _, ok := fragmentKey(nil, n); ok {
			wg.Add(1)
			go func() { defer wg.Done(); muts[i] = mutants(n) }()
		}
	}
	wg.Wait()
	for _, m := range muts {
		nodes = append(nodes, m...)
	}
	type keys struct{ custom, proto []byte }
	var ks []keys
	fallback := 0
	for _, n := range nodes {
		c, ok := fragmentKey(nil, n)
		if !ok {
			fallback++
			continue
		}
		p, err := proto.MarshalOptions{Deterministic: true}.Marshal(n)
		if err != nil {
			t.Fatal(err)
		}
		ks = append(ks, keys{c, p})
	}
	if len(ks) < 1000 || fallback == 0 {
		t.Fatalf("%d nodes keyed, %d fell back: the test does not cover the encoder", len(ks), fallback)
	}
	byCustom := map[string]string{}
	byProto := map[string]string{}
	for _, k := range ks {
		if p, ok := byCustom[string(k.custom)]; ok && p != string(k.proto) {
			t.Fatalf("two different nodes share a fragment key")
		}
		if c, ok := byProto[string(k.proto)]; ok && !bytes.Equal([]byte(c), k.custom) {
			t.Fatalf("one node has two fragment keys")
		}
		byCustom[string(k.custom)], byProto[string(k.proto)] = string(k.proto), string(k.custom)
	}
	t.Logf("%d nodes keyed (%d distinct), %d fell back to protobuf", len(ks), len(byCustom), fallback)
}
