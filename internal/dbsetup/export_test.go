package dbsetup

// ByPrimaryKey is byPrimaryKey, for the tests that install the
// procedures of earlier versions.
var ByPrimaryKey = byPrimaryKey

// WatchSQLV3 is watch.sql with catalog_changed as setup installed it
// before it counted temporary functions and procedures.
var WatchSQLV3 = tempCounted.replace(watchSQL)
