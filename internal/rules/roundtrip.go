package rules

import (
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/reflect/protoreflect"
)

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
	case "location", "stmt_location", "stmt_len",
		// pg_query 6's other positions (DefElem's argument, NOTIFY's
		// payload, a name, a subscription's connection string).
		"arg_location", "payload_location", "name_location", "conninfo_location":
		return true
	}
	return false
}
