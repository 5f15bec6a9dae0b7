package catalog

// The indirect paths the graph yields, with the chains of steps that
// name them.

import (
	"fmt"
	"slices"
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// paths searches the graph from every statement that can name a
// relation. From a protected table only the steps that run a statement
// of their own count (firstSteps): its rules, its and its descendants'
// foreign keys' actions and TRUNCATE ... CASCADE. The rewrite fences the
// write of the table itself, which reaches its descendants' rows with
// the same fence; a rule action's or a foreign key action's query is
// another statement, which no fence reaches.
func (g *pathGraph) paths() []IndirectPath {
	if len(g.protected) == 0 {
		return nil
	}
	useful := g.usefulStates()

	type key struct {
		rel, target uint32
		via         string
	}
	found := map[key]*IndirectPath{}
	ops := map[key][pathOpCount]bool{}
	var order []key
	for oid, r := range g.rels {
		for _, op := range g.startOps(r) {
			start := pathState{rel: oid, op: op, mode: modeNamed}
			if !useful[start] {
				continue
			}
			for _, first := range g.firstSteps(start) {
				if !useful[first.to] {
					continue
				}
				for target, chain := range g.shortestChains(first.pathEdge, useful) {
					k := key{rel: oid, target: target, via: joinSteps(slices.Concat(first.prefix, chain))}
					if found[k] == nil {
						up := first.to.mode == modeRows
						found[k] = &IndirectPath{Schema: r.schema, Name: r.name, Kind: first.kind, Target: g.rels[target].display, Via: k.via, Columns: first.cols,
							NewChildren: up, NewPartitions: up || first.kind == PathForeignKey || first.kind == PathTruncate}
						order = append(order, k)
					}
					o := ops[k]
					o[op] = true
					ops[k] = o
				}
			}
		}
	}
	out := make([]IndirectPath, 0, len(order))
	for _, k := range order {
		p := found[k]
		for op, ok := range ops[k] {
			if ok {
				p.Ops = append(p.Ops, pathOpNames[op])
			}
		}
		out = append(out, *p)
	}
	sortPaths(out)
	return out
}

// sortPaths sorts paths by Schema, Name, Target, Kind and Via.
func sortPaths(paths []IndirectPath) {
	slices.SortFunc(paths, func(a, b IndirectPath) int {
		for _, c := range [...]int{
			strings.Compare(a.Schema, b.Schema), strings.Compare(a.Name, b.Name),
			strings.Compare(a.Target, b.Target), strings.Compare(a.Kind, b.Kind), strings.Compare(a.Via, b.Via),
		} {
			if c != 0 {
				return c
			}
		}
		return 0
	})
}

// latentPaths returns one PathLatent entry for each relation, other than
// a protected table, that has rules or is a view, and from which a
// statement would reach a protected table were the edges pessimistic
// (every rule enabled and none replacing the write, every view with
// INSTEAD OF triggers): DDL on its rules or triggers may open a path.
// Relations already starts of paths get one too (such DDL may open a
// path for another kind of statement). Its Target and Via are those of
// the first such path in sort order.
func (g *pathGraph) latentPaths() []IndirectPath {
	g.pessimistic, g.edgeMemo = true, map[pathState][]pathEdge{}
	defer func() { g.pessimistic, g.edgeMemo = false, map[pathState][]pathEdge{} }()
	var out []IndirectPath
	seen := map[uint32]bool{}
	for _, p := range g.paths() {
		oid := g.byName[Rel{p.Schema, p.Name}]
		r := g.rels[oid]
		if seen[oid] || g.protected[oid] || (r.kind != 'v' && len(r.rules) == 0) {
			continue
		}
		seen[oid] = true
		p.Kind, p.Ops, p.Columns, p.NewPartitions, p.NewChildren = PathLatent, nil, nil, false, false
		out = append(out, p)
	}
	return out
}

// firstStep is the step a path is named by (its kind, and its columns),
// after prefix, the steps that lead to it.
type firstStep struct {
	pathEdge
	prefix []string
}

// firstSteps returns the steps from start a path may begin with. From an
// unprotected relation, every step. From a protected table, the steps
// that run a statement of their own, from the table itself or from any
// descendant its write reaches (a partition's foreign key action runs
// for the rows the parent's write changed there), with the inheritance
// and partitioning steps that lead to them as prefix.
func (g *pathGraph) firstSteps(start pathState) []firstStep {
	if !g.protected[start.rel] {
		edges := g.edges(start)
		out := make([]firstStep, len(edges))
		for i, e := range edges {
			out[i] = firstStep{pathEdge: e}
		}
		return out
	}
	var out []firstStep
	prefixes := map[pathState][]string{start: nil}
	queue := []pathState{start}
	for len(queue) > 0 {
		s := queue[0]
		queue = queue[1:]
		for _, e := range g.edges(s) {
			switch {
			case ownStatement[e.kind]:
				out = append(out, firstStep{pathEdge: e, prefix: prefixes[s]})
			case e.to.mode == modeChild && (e.kind == PathPartition || e.kind == PathInheritance):
				if _, seen := prefixes[e.to]; !seen {
					prefixes[e.to] = append(slices.Clip(prefixes[s]), e.via)
					queue = append(queue, e.to)
				}
			}
		}
	}
	return out
}

// ownStatement are the kinds of step that run a statement of their own,
// which the fence of the statement that names a protected table does not
// reach.
var ownStatement = map[string]bool{PathRule: true, PathForeignKey: true, PathTruncate: true}

// usefulStates returns the states from which a protected table is reached:
// it explores every state reachable from a statement naming a relation,
// then walks the steps backwards from the protected tables.
func (g *pathGraph) usefulStates() map[pathState]bool {
	back := map[pathState][]pathState{}
	seen := map[pathState]bool{}
	var queue []pathState
	for oid, r := range g.rels {
		for _, op := range g.startOps(r) {
			s := pathState{rel: oid, op: op, mode: modeNamed}
			if !seen[s] {
				seen[s] = true
				queue = append(queue, s)
			}
		}
	}
	var targets []pathState
	for len(queue) > 0 {
		s := queue[0]
		queue = queue[1:]
		if g.protected[s.rel] {
			targets = append(targets, s)
		}
		for _, e := range g.edges(s) {
			back[e.to] = append(back[e.to], s)
			if !seen[e.to] {
				seen[e.to] = true
				queue = append(queue, e.to)
			}
		}
	}
	useful := map[pathState]bool{}
	for _, t := range targets {
		useful[t] = true
	}
	for len(targets) > 0 {
		s := targets[0]
		targets = targets[1:]
		for _, p := range back[s] {
			if !useful[p] {
				useful[p] = true
				targets = append(targets, p)
			}
		}
	}
	return useful
}

// shortestChains searches breadth-first from first's destination, through
// useful states, and returns for each protected table reached the
// explanations of the shortest chain of steps, first included.
func (g *pathGraph) shortestChains(first pathEdge, useful map[pathState]bool) map[uint32][]string {
	type visit struct {
		prev *visit
		via  string
	}
	chain := func(v *visit) []string {
		var out []string
		for ; v != nil; v = v.prev {
			out = append(out, v.via)
		}
		slices.Reverse(out)
		return out
	}
	result := map[uint32][]string{}
	visits := map[pathState]*visit{first.to: {via: first.via}}
	queue := []pathState{first.to}
	for len(queue) > 0 {
		s := queue[0]
		queue = queue[1:]
		v := visits[s]
		if g.protected[s.rel] {
			if _, ok := result[s.rel]; !ok {
				result[s.rel] = chain(v)
			}
		}
		for _, e := range g.edges(s) {
			if !useful[e.to] || visits[e.to] != nil {
				continue
			}
			visits[e.to] = &visit{prev: v, via: e.via}
			queue = append(queue, e.to)
		}
	}
	return result
}

// maxViaSteps bounds the steps Via spells out: a long chain of foreign
// keys keeps its first and last steps.
const maxViaSteps = 8

// joinSteps joins the explanations of a chain of steps.
func joinSteps(chain []string) string {
	if len(chain) > maxViaSteps {
		head, tail := chain[:maxViaSteps/2], chain[len(chain)-maxViaSteps/2:]
		mid := "... 1 more step ..."
		if n := len(chain) - len(head) - len(tail); n > 1 {
			mid = fmt.Sprintf("... %d more steps ...", n)
		}
		chain = slices.Concat(head, []string{mid}, tail)
	}
	return strings.Join(chain, "; ")
}

// pathRelName is schema.name for display, quoted as rules.TableSpec.Display
// quotes it.
func pathRelName(schema, name string) string {
	return sqllex.DisplayIdent(schema) + "." + sqllex.DisplayIdent(name)
}
