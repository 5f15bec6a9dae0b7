package rules

import (
	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// repeatableFuncs are built-in functions (and aggregates) that are immutable
// or stable and have no side effects: evaluating them twice for the same row
// in one statement gives the same answer. The list is deliberately small;
// a function outside it (including every user-defined function) makes a
// DELETE condition non-repeatable, which only selects the slower but
// single-evaluation rewrite form. Names are matched unqualified or
// qualified with pg_catalog.
var repeatableFuncs = map[string]bool{}

func init() {
	for _, n := range []string{
		// strings
		"lower", "upper", "initcap", "length", "char_length", "character_length", "octet_length", "bit_length",
		"btrim", "ltrim", "rtrim", "trim", "substr", "substring", "left", "right", "replace", "translate",
		"concat", "concat_ws", "format", "lpad", "rpad", "repeat", "reverse", "position", "strpos",
		"starts_with", "split_part", "md5", "sha256", "sha512", "encode", "decode", "quote_ident",
		"quote_literal", "quote_nullable", "regexp_replace", "regexp_match", "regexp_like", "ascii", "chr",
		"to_hex", "string_to_array", "array_to_string", "overlay",
		// numbers
		"abs", "ceil", "ceiling", "floor", "round", "trunc", "mod", "power", "sqrt", "sign", "div",
		"greatest", "least", "width_bucket",
		// time (stable within a statement)
		"now", "statement_timestamp", "transaction_timestamp", "current_date", "current_time",
		"current_timestamp", "localtime", "localtimestamp", "date_trunc", "date_part", "extract",
		"date_bin", "age", "to_char", "to_date", "to_timestamp", "to_number", "make_date", "make_time",
		"make_timestamp", "make_timestamptz", "make_interval", "timezone", "isfinite", "justify_days",
		"justify_hours", "justify_interval",
		// arrays, json
		"array_length", "array_lower", "array_upper", "array_position", "array_positions", "cardinality",
		"array_append", "array_prepend", "array_cat", "array_remove", "array_replace",
		"json_extract_path", "json_extract_path_text", "jsonb_extract_path", "jsonb_extract_path_text",
		"json_typeof", "jsonb_typeof", "jsonb_array_length", "json_array_length", "jsonb_exists",
		"to_json", "to_jsonb", "jsonb_build_object", "json_build_object", "jsonb_build_array",
		"json_build_array", "jsonb_path_exists", "jsonb_path_match",
		// misc
		"coalesce", "nullif", "current_setting", "current_user", "session_user", "current_schema",
		"current_database", "pg_typeof", "hashtext", "num_nulls", "num_nonnulls",
		// aggregates (in sub-selects)
		"count", "sum", "min", "max", "avg", "bool_and", "bool_or", "every", "array_agg", "string_agg",
		"jsonb_agg", "json_agg",
	} {
		repeatableFuncs[n] = true
	}
}

// repeatable reports whether expression n can be evaluated a second time
// for the same row with the same result and no extra side effect: it calls
// only functions from repeatableFuncs. Operators and casts are assumed to
// be built-in ones (user-defined volatile operators are not detected).
func repeatable(n *pg.Node) bool {
	return !hasNode(n, func(m protoreflect.ProtoMessage) bool {
		fc, ok := m.(*pg.FuncCall)
		if !ok {
			return false
		}
		names := fc.Funcname
		switch {
		case len(names) == 1:
		case len(names) == 2 && names[0].GetString_().GetSval() == "pg_catalog":
		default:
			return true
		}
		return !repeatableFuncs[names[len(names)-1].GetString_().GetSval()]
	})
}
