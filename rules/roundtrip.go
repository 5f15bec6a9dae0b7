package rules

import (
	"bytes"
	"fmt"

	pg "github.com/pganalyze/pg_query_go/v6"
	"github.com/pganalyze/pg_query_go/v6/parser"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// deparseChecked prints one rewritten statement and proves the print
// faithful: the text is parsed again and must give back the tree that was
// built, source positions aside. The server then runs exactly the fenced
// statement, whatever quirks the deparser has with unusual input (a
// precedence slip in a client expression could otherwise detach an added
// condition); a statement that fails the check is refused.
//
// The comparison works on the protobuf encodings (the one handed to the
// deparser and the one the parser returns), so the reparsed tree is never
// decoded into Go structs.
func deparseChecked(version int32, raw *pg.RawStmt) (string, error) {
	built, err := proto.Marshal(&pg.ParseResult{Version: version, Stmts: []*pg.RawStmt{raw}})
	if err != nil {
		return "", err
	}
	md := (&pg.ParseResult{}).ProtoReflect().Descriptor()
	if d := protoDepth(built, md); d < 0 || d > maxDeparseDepth {
		// The deparser's stack use grows with the depth (see depth.go).
		return "", fmt.Errorf("the statement nests %d levels deep, more than the %d fenceproxy can print safely; nest fewer subqueries or shorten chains of operators, UNIONs or JOINs", d, maxDeparseDepth)
	}
	text, err := parser.DeparseFromProtobuf(built)
	if err != nil {
		return "", err
	}
	back, err := parser.ParseToProtobuf(text)
	if err != nil {
		return "", fmt.Errorf("the rewritten statement does not parse: %v", err)
	}
	a, okA := canonical(nil, built, md)
	b, okB := canonical(nil, back, md)
	if !okA || !okB || !bytes.Equal(a, b) {
		return "", fmt.Errorf("the rewritten statement does not print faithfully")
	}
	return text, nil
}

// canonical appends to dst a canonical form of the protobuf message src
// (of type md) that ignores source positions: location fields are dropped,
// and sub-messages are delimited by start/end group markers instead of
// length prefixes, so no lengths need recomputing. Two trees are equal
// apart from positions exactly when their canonical forms are equal, given
// that both encoders write fields in field-number order (Go's and
// protobuf-c's both do). It reports false for malformed input.
func canonical(dst, src []byte, md protoreflect.MessageDescriptor) ([]byte, bool) {
	fields := md.Fields()
	for len(src) > 0 {
		num, typ, n := protowire.ConsumeTag(src)
		if n < 0 {
			return nil, false
		}
		src = src[n:]
		fd := fields.ByNumber(num)
		switch typ {
		case protowire.VarintType:
			v, n := protowire.ConsumeVarint(src)
			if n < 0 {
				return nil, false
			}
			src = src[n:]
			if fd != nil && isPosition(fd) {
				continue
			}
			dst = protowire.AppendTag(dst, num, typ)
			dst = protowire.AppendVarint(dst, v)
		case protowire.BytesType:
			v, n := protowire.ConsumeBytes(src)
			if n < 0 {
				return nil, false
			}
			src = src[n:]
			if fd != nil && fd.Kind() == protoreflect.MessageKind {
				dst = protowire.AppendTag(dst, num, protowire.StartGroupType)
				var ok bool
				if dst, ok = canonical(dst, v, fd.Message()); !ok {
					return nil, false
				}
				dst = protowire.AppendTag(dst, num, protowire.EndGroupType)
				continue
			}
			dst = protowire.AppendTag(dst, num, typ)
			dst = protowire.AppendBytes(dst, v)
		default:
			n := protowire.ConsumeFieldValue(num, typ, src)
			if n < 0 {
				return nil, false
			}
			dst = protowire.AppendTag(dst, num, typ)
			dst = append(dst, src[:n]...)
			src = src[n:]
		}
	}
	return dst, true
}

// isPosition reports whether fd holds a source position, which printing a
// tree cannot preserve.
func isPosition(fd protoreflect.FieldDescriptor) bool {
	switch fd.Name() {
	case "location", "stmt_location", "stmt_len":
		return true
	}
	return false
}
