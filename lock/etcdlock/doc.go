// Package etcdlock takes named locks in etcd and hands out fencing tokens;
// its Lease is a lock.Grant, and New makes a lock.Locker.
//
// It is built on etcd's client/v3/concurrency, so a lock taken here and
// "etcdctl lock NAME" (or any concurrency.Mutex on NAME) exclude each other
// and wait in one line.
//
// Key layout. A lock NAME is the prefix NAME + "/" (Prefix). Acquire
// grants an etcd lease of lock.Options.TTL, rounded up to whole seconds
// (the server may grant more: Lease.TTL says what it granted), starts a
// concurrency.Session on it (the keep-alive, which also runs while the
// grant waits in line, so a waiter keeps its place), and creates the
// holder key (HolderKey)
//
//	NAME/<lease ID in lower-case hex>
//
// attached to the lease, with lock.Options.Holder as its value (etcdctl
// leaves it empty). The key with the smallest creation revision under the
// prefix holds the lock; every other key is a waiter, and each waiter
// watches only the deletion of the key created just before its own
// (concurrency.Mutex), so a release wakes one waiter and waiters get the
// lock in the order they queued. Names that are prefixes of each other
// ("a" and "a/b") share keys under "a/": a holder of "a/b" also keeps "a"
// waiting; pick names that do not nest.
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
//     reports lock.ErrNotHeld and leaves other keys alone.
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
package etcdlock
