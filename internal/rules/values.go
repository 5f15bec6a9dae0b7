package rules

import (
	"strings"

	pg "github.com/pganalyze/pg_query_go/v6"
)

// Large multi-row VALUES lists.
//
// ORMs and loaders send INSERTs with thousands of VALUES rows. Parsing the
// whole statement twice (the client's text and the checked splice) costs
// several times a parse of it, and its tree about 200 times its size. But
// rows that hold nothing but literals and parameters are all alike to the
// rewriter: they contain no statement, no call (so no set_config), no
// name, and each gets the same stamp as any later row of its list. So when
// a VALUES list has many such rows, the rewriter decides on a reduced
// statement that keeps the first two rows and drops the rest, which is
// parsed, rewritten, spliced and checked as usual; the dropped rows are
// then put back, verbatim, each with exactly the text the check proved for
// the second row appended before its closing parenthesis. What PostgreSQL's
// own scanner says about the dropped rows decides whether they qualify, so
// they are tokenised exactly as the server will.

// valuesFastMinRows is the number of VALUES rows from which the reduced
// statement is used; below it the whole statement is parsed as usual.
const valuesFastMinRows = 64

// valuesFastMinBytes is the statement size from which a long VALUES list
// is looked for at all.
const valuesFastMinBytes = 4 << 10

// valuesList is a run of parenthesised rows after a VALUES keyword, as
// token indices of each row's "(" and ")".
type valuesList struct {
	open, close []int
}

// decideValuesFast decides sql through a reduced statement when it has a
// long VALUES list of plain rows (see above). ok is false when it does not
// apply, and the statement must take the usual path; toks are then sql's
// tokens, for it to reuse.
func (r *Rules) decideValuesFast(sql string) (d Decision, ok bool, toks []scanTok) {
	sp, err := newSplicer(sql)
	if err != nil {
		return Decision{}, false, nil
	}
	no := func() (Decision, bool, []scanTok) { return Decision{}, false, sp.toks }
	vl, ok := sp.longestValuesList()
	if !ok || len(vl.open) < valuesFastMinRows {
		return no()
	}
	width := sp.rowWidth(vl.open[1])
	for k := 2; k < len(vl.open); k++ {
		if !sp.plainRow(vl.open[k], vl.close[k]) || sp.rowWidth(vl.open[k]) != width {
			return no()
		}
	}
	// The reduced statement: rows 3..N dropped, with the comma before
	// each.
	p := sp.toks[vl.close[1]].end
	q := sp.toks[vl.close[len(vl.close)-1]].end
	reduced := sql[:p] + sql[q:]
	rd, res := r.decideFull(reduced, nil)
	// The reduced text's token form is not the statement's, which has
	// none (it is too large for one to pay).
	rd.Tok = nil
	if rd.Action != Rewrite {
		// Dropped rows cannot write, name or call anything: the decision
		// is the whole statement's.
		if rd.Lock != nil {
			// The registrations of the reduced text, with the rows put
			// back where they were dropped.
			rd.Lock = rd.Lock.growAt(sql, p, q-p)
		}
		return rd, true, nil
	}
	if sp.err != nil || res.sp.copied {
		// A fragment repeats some of the client's text (a DELETE's WHERE,
		// a MERGE condition, a value kept): it may hold the list, whose
		// copy would then lack the dropped rows.
		return no()
	}
	out := rd.SQL
	rowStart := sp.toks[vl.open[1]].start
	stampAt := sp.endOf(vl.close[1]) // where a stamp is appended to row 2
	stamp := ""
	shift := 0 // how far offsets before p moved in out
	for _, e := range res.sp.edits {
		delta := len(e.text.real) - (e.end - e.start)
		switch {
		case e.end <= rowStart:
			shift += delta // before row 2
		case e.start == e.end && e.start == stampAt && stamp == "":
			stamp = e.text.real
			shift += delta
		case e.start > p || e.start == p && e.end > p:
			// after row 2's ")"
		default:
			return no() // row 2 changed otherwise
		}
	}
	var b strings.Builder
	b.Grow(len(out) + (len(vl.open)-2)*len(stamp) + q - p)
	b.WriteString(out[:p+shift])
	pos := p
	for k := 2; k < len(vl.open); k++ {
		at := sp.endOf(vl.close[k])
		b.WriteString(sql[pos:at])
		b.WriteString(stamp)
		pos = at
	}
	b.WriteString(sql[pos:q])
	b.WriteString(out[p+shift:])
	rd.SQL = b.String()
	if rd.Lock != nil {
		rd.Lock = rd.Lock.growAt(rd.SQL, p+shift, len(rd.SQL)-len(out))
	}
	return rd, true, nil
}

// longestValuesList finds the VALUES keyword followed by the most rows.
func (s *splicer) longestValuesList() (valuesList, bool) {
	var best valuesList
	// Each token is looked at a bounded number of times: after a list,
	// the search goes on behind it (lists nested in its rows are skipped).
	for i := 0; i < len(s.toks); i++ {
		if s.toks[i].tok != pg.Token_VALUES {
			continue
		}
		var vl valuesList
		j := i + 1
		for j < len(s.toks) && s.toks[j].tok == pg.Token_ASCII_40 {
			c := s.level(j+1, nil)
			if c >= len(s.toks) || s.toks[c].tok != pg.Token_ASCII_41 {
				break
			}
			vl.open, vl.close = append(vl.open, j), append(vl.close, c)
			i = c
			if c+1 >= len(s.toks) || s.toks[c+1].tok != pg.Token_ASCII_44 {
				break
			}
			j = c + 2
		}
		if len(vl.open) > len(best.open) {
			best = vl
		}
	}
	return best, len(best.open) >= 2
}

// plainRow reports whether the row between tokens open and close is a
// comma-separated list of plain items: DEFAULT, or signs before a literal,
// a parameter, NULL, TRUE or FALSE, optionally cast to one-word type names
// (1, -2.5, 'x', $3, NULL, $4::uuid, '1'::int::text). Such items hold
// nothing that could name, call or nest, and a row of them parses whatever
// its neighbours, so the rewriter need not see it.
func (s *splicer) plainRow(open, close int) bool {
	j := open + 1
	for {
		if j >= close {
			return false // empty row, or a trailing comma
		}
		if s.toks[j].tok == pg.Token_DEFAULT {
			j++
		} else {
			for j < close && (s.toks[j].tok == pg.Token_ASCII_43 || s.toks[j].tok == pg.Token_ASCII_45) {
				j++
			}
			if j >= close {
				return false
			}
			switch s.toks[j].tok {
			case pg.Token_ICONST, pg.Token_FCONST, pg.Token_SCONST, pg.Token_BCONST, pg.Token_XCONST,
				pg.Token_PARAM, pg.Token_NULL_P, pg.Token_TRUE_P, pg.Token_FALSE_P:
				j++
			default:
				return false
			}
			for j+1 < close && s.toks[j].tok == pg.Token_TYPECAST && s.typeWord(j+1) {
				j += 2
			}
		}
		switch {
		case j == close:
			return true
		case s.toks[j].tok != pg.Token_ASCII_44:
			return false
		}
		j++
	}
}

// typeWord reports whether token j can be a one-word type name: a name, or
// a keyword that may name a type (unreserved, or a column-name keyword
// such as int or boolean).
func (s *splicer) typeWord(j int) bool {
	switch t := s.toks[j]; {
	case t.tok == pg.Token_IDENT:
		return true
	case t.kind == pg.KeywordKind_UNRESERVED_KEYWORD || t.kind == pg.KeywordKind_COL_NAME_KEYWORD:
		return true
	}
	return false
}

// rowWidth counts the items of the row opened by token open: its commas at
// its own level, plus one.
func (s *splicer) rowWidth(open int) int {
	n := 1
	for j := open + 1; ; j++ {
		j = s.level(j, s.is(pg.Token_ASCII_44))
		if j >= len(s.toks) || s.toks[j].tok != pg.Token_ASCII_44 {
			return n
		}
		n++
	}
}
