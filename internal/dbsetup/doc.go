// Package dbsetup prepares and checks a database for fenceproxy: the
// fenceproxy schema with the lock watermarks and the register procedure
// (objects.sql, version Version), and the fence columns of the protected
// tables.
//
// Setup installs or upgrades the objects and, when asked, adds missing
// fence columns, in one transaction; running it again changes nothing.
// Check changes nothing: it reports what the proxy would trip over (a
// missing or ill-typed fence column, missing or outdated objects, login
// roles that may use a protected table but not the objects or the fence
// column), each problem with the SQL or command that fixes it. Checker
// runs Check in the background for the proxy, once per database it serves.
//
// Both work on one database, the one their connection is to; an entry of
// the configuration applies to a database when its scope.databases is empty
// or lists that database. Databases lists the databases a configuration
// needs.
//
// The database guard (SetupOptions.Guard) is internal/guard's, and the
// catalog reads shared with it, with the indirect paths the Checker looks
// for, are internal/catalog's: dbsetup imports both, neither imports
// dbsetup.
package dbsetup
