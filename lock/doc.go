// Package lock takes named locks in etcd or Redis and hands out fencing
// tokens.
//
// Both services sit behind one interface: Locker (Etcd, NewRedis) hands out
// a Grant with a token, Done, Renew and Release, so a program picks the
// service by configuration. The etcd backend is described first below;
// the Redis backend (RedisLease) takes the lock and draws the token from
// a counter in one server-side script, in the key layout of Redisson's
// RFencedLock, serves its waiters first come, first served through a line
// in the lock's hash slot (Redis.Acquire), and is safe only on a Redis
// that keeps that counter: docs/tokens.md in the repository says which
// settings that takes, how to seed a lost counter (Redis.SeedToken), and
// which numbers of other lock services are safe tokens.
//
// It is built on etcd's client/v3/concurrency, so a lock taken here and
// "etcdctl lock NAME" (or any concurrency.Mutex on NAME) exclude each other
// and wait in one line.
//
// Key layout. A lock NAME is the prefix NAME + "/". Acquire grants an etcd
// lease, starts a concurrency.Session on it (the keep-alive), and creates
// the holder key
//
//	NAME/<lease ID in lower-case hex>
//
// attached to the lease, with Options.Holder as its value (etcdctl leaves it
// empty). The key with the smallest creation revision under the prefix holds
// the lock; every other key is a waiter, and each waiter watches only the
// deletion of the key created just before its own (concurrency.Mutex), so a
// release wakes one waiter and waiters get the lock in the order they
// queued. Names that are prefixes of each other ("a" and "a/b") share keys
// under "a/": a holder of "a/b" also keeps "a" waiting; pick names that do
// not nest.
//
// The fencing token is the holder key's creation revision. It is the
// revision etcdctl lock reports when it did not have to wait (its
// ETCD_LOCK_REV is the revision at which it got the lock, which is later
// when it waited; the creation revision of its ETCD_LOCK_KEY is the token
// in every case).
//
// Guarantees:
//
//   - At most one holder key is the oldest under a prefix; a holder key
//     exists only while its lease lives.
//   - Tokens of successive holders strictly increase and are never reused,
//     whichever client took the lock. They are etcd revisions, which are
//     cluster-wide, so they skip numbers; only their order matters. They
//     lie in 1 .. 2^63-1.
//   - Release deletes the holder key only if it still belongs to the
//     caller's grant (same creation revision and lease); otherwise it
//     reports ErrNotHeld and leaves other keys alone.
//   - Lease.Done is closed when the holder can no longer count on the lock:
//     the lease expired by the local clock (measured from before the grant
//     request, or from before a renewal after a long wait, so it errs on the
//     early side), keep-alive failed, or the holder key was deleted or
//     replaced in etcd.
//
// What it cannot guarantee: a holder that stops (GC pause, swapped out,
// paused VM) keeps believing it holds the lock after its lease is gone, and
// Done fires only when it runs again. That is the reason for fencing tokens:
// the storage must refuse a write whose token is older than one it has seen.
// Done narrows the window; the token closes it.
//
// To carry a grant to PostgreSQL, Lease.ConfigurePgx puts the token and
// the lock's name into a pgx connection's startup parameters, and
// Lease.PGOptions formats them for libpq's PGOPTIONS. Behind a transaction
// pooler, which moves transactions between server sessions, BeginTx (pgx)
// and BeginSQL (database/sql) set both with set_config(…, true) inside
// each transaction instead.
//
// Operator caveat — snapshot restore: tokens are revisions, so restoring etcd
// from an old snapshot moves revisions backwards and would hand out tokens
// that were already used, which fenced storage then accepts as "newer" than
// they are, or refuses for the new holder. Restore with
//
//	etcdutl snapshot restore snapshot.db --bump-revision 1000000000 --mark-compacted ...
//
// choosing a bump larger than the number of revisions written since the
// snapshot was taken, so every token issued after the restore is larger than
// every token issued before it.
package lock
