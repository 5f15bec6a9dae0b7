package dbsetup

// ByPrimaryKey is byPrimaryKey, for the tests that install the
// procedures of earlier versions.
var ByPrimaryKey = byPrimaryKey
