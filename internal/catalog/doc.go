// Package catalog reads what fenceproxy needs from a database's
// pg_catalog: the protected tables and their fence columns (LookupTable,
// LookupColumn), a schema's objects (SchemaFingerprint), and the paths
// through which a statement writes a protected table without naming it
// (IndirectPaths): views, rules, INSTEAD OF triggers, inheritance and
// partitions, foreign-key actions and TRUNCATE ... CASCADE, read from the
// catalog and the rules' node trees (pg_node_tree, nodetree.go).
//
// It only reads. Of fenceproxy's packages it imports internal/sqllex only:
// internal/dbsetup and internal/guard build on it, and the proxy's policy
// refuses the paths it finds (docs/design.md, "DDL that reaches a protected
// table without naming it").
package catalog
