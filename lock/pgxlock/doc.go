// Package pgxlock carries a lock's grant into pgx connections and
// transactions: the token and the lock's name of a lock.Fence, in the
// settings it names.
//
// Configure puts both into a pgx.ConnConfig's startup parameters, so that
// every connection made from it has them for the whole session. Behind a
// transaction pooler, which moves transactions between server sessions,
// BeginTx (or Apply, in a transaction already open) sets them with
// set_config(…, true) inside each transaction instead. lock.BeginSQL is
// the same for database/sql, without pgx.
package pgxlock
