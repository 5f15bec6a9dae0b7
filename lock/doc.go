// Package lock is what an application needs to carry a lock's fencing
// token to PostgreSQL, whichever service issued it, with nothing but the
// standard library.
//
// A Locker hands out a Grant: the lock's name, a fencing token larger than
// every earlier holder's, Done, Renew and Release. Its Fence carries both
// to PostgreSQL in the settings fence.token and fence.lock (Settings names
// others): as startup parameters (Fence.RuntimeParams), as libpq options
// for PGOPTIONS (Fence.PGOptions, AppendPGOptions), or, behind a
// transaction pooler, which moves transactions between server sessions,
// with set_config(…, true) inside each transaction (BeginSQL and
// Fence.ApplySQL for database/sql, Fence.SQL for any other driver).
// docs/clients.md in the repository says how fenceproxy fences the
// statements of such a session, and docs/tokens.md which tokens are safe.
//
// The services and drivers are sub-packages, each importing only its own
// client:
//
//   - etcdlock takes locks in etcd (client/v3), compatible with
//     "etcdctl lock": etcdlock.Acquire, etcdlock.New for a Locker.
//   - redislock takes locks in Redis (go-redis), in the key layout of
//     Redisson's RFencedLock: redislock.New.
//   - pgxlock puts a grant into pgx connections and transactions:
//     pgxlock.Configure, pgxlock.BeginTx.
//
// Go compiles only the packages a program imports, so a program that uses
// lib/pq and Redis builds neither pgx nor etcd's client. The sub-packages
// live in the fenceproxy module rather than in a module of their own, so
// that the repository's "go test ./..." covers them with no go.work or
// replace directives; the price is that an importer's module graph
// includes fenceproxy's requirements (their go.mod files, for version
// selection, which may raise a dependency it shares) and its go
// directive.
package lock
