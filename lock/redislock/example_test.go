package redislock_test

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/redislock"
)

// A lock in Redis behind the lock.Locker interface; the code that uses
// the grant is the same as with etcd.
func ExampleNew() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer rdb.Close()
	var locker lock.Locker = redislock.New(rdb, redislock.Options{})
	wait, cancel := context.WithTimeout(ctx, 5*time.Second) // the wait bound
	defer cancel()
	g, err := locker.Acquire(wait, "config:1", lock.Options{TTL: 10 * time.Second})
	if err != nil {
		return
	}
	defer g.Release(ctx)
	_ = g.Token() // the fencing token, strictly increasing across holders
}

// After Redis lost the token counter, and before anyone takes the lock,
// raise it above the highest token the database has seen, plus a margin
// for grants drawn before the loss and not yet registered.
func ExampleLocker_SeedToken() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer rdb.Close()
	r := redislock.New(rdb, redislock.Options{})
	var highest int64 // SELECT token FROM fenceproxy.locks WHERE name = 'config:1'
	const margin = 1_000_000
	if _, err := r.SeedToken(ctx, "config:1", highest+margin); err != nil { // never lowers the counter
		return
	}
}

// The counter shares the lock's hash slot: its key carries the lock's
// name as a hash tag, unless the name has one of its own.
func ExampleTokenKey() {
	fmt.Println(redislock.TokenKey("config:1"))
	fmt.Println(redislock.TokenKey("{tenant7}:config"))
	// Output:
	// redisson_lock_token:{config:1}
	// redisson_lock_token:{tenant7}:config
}
