package redislock

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/internal/held"
)

// Redis key layout, the one Redisson's RFencedLock uses (see the package
// documentation): the lock is a hash at the lock's name whose one field
// names the holder, the token counter is a string key whose hash tag is
// the lock's name, and releases are announced on a channel of the same
// tag.
const (
	redisTokenPrefix   = "redisson_lock_token"
	redisChannelPrefix = "redisson_lock__channel"
	// The line of waiters and their deadlines: this backend's own keys
	// (Redisson's RFencedLock has no line; see Acquire).
	redisQueuePrefix    = "fenceproxy_lock_queue"
	redisDeadlinePrefix = "fenceproxy_lock_queue_deadline"
	// redisUnlockMessage is what a release publishes (Redisson's
	// LockPubSub.UNLOCK_MESSAGE).
	redisUnlockMessage = "0"
)

// redisAcquire takes the lock and draws its token in one step, first come
// first served among this backend's waiters. KEYS[1] is the lock hash,
// KEYS[2] the token counter, KEYS[3] the waiters (a sorted set of holder
// fields by arrival) and KEYS[4] their deadlines (a hash, server time in
// milliseconds); all four share the hash tag, so one slot. ARGV[1] is the
// TTL in milliseconds, ARGV[2] this grant's holder field, ARGV[3] "wait"
// to join the line (or keep its place) when the lock cannot be taken now,
// ARGV[4] how long a waiter keeps its place without trying again.
//
// Waiters whose deadline has passed (a process that died or stopped) are
// dropped from the head of the line first. The lock is taken only if it
// is free and no live waiter is ahead: the line is empty or this grant is
// at its head; so TryAcquire does not overtake a waiter either. The INCR
// comes before the lock is written: if the counter is not an integer the
// script fails before it takes anything. It returns {-1, token} when
// taken, otherwise {pttl, holder field, current counter} (false for
// either when absent).
var redisAcquire = redis.NewScript(`
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('time')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local head
while true do
	head = redis.call('zrange', KEYS[3], 0, 0)[1]
	if not head then break end
	if tonumber(redis.call('hget', KEYS[4], head) or '0') >= now then break end
	redis.call('zrem', KEYS[3], head)
	redis.call('hdel', KEYS[4], head)
end
if redis.call('exists', KEYS[1]) == 0 and (not head or head == ARGV[2]) then
	local token = redis.call('incr', KEYS[2])
	redis.call('hset', KEYS[1], ARGV[2], 1)
	redis.call('pexpire', KEYS[1], ARGV[1])
	if head then
		redis.call('zrem', KEYS[3], ARGV[2])
		redis.call('hdel', KEYS[4], ARGV[2])
	end
	return {-1, token}
end
if ARGV[3] == 'wait' then
	-- The score is the arrival in microseconds, written as a string: Lua
	-- would print the number with 14 digits.
	redis.call('zadd', KEYS[3], 'NX', t[1] .. string.format('%06d', tonumber(t[2])), ARGV[2])
	redis.call('hset', KEYS[4], ARGV[2], now + tonumber(ARGV[4]))
	redis.call('pexpire', KEYS[3], ARGV[4])
	redis.call('pexpire', KEYS[4], ARGV[4])
end
local holder = false
if redis.call('type', KEYS[1]).ok == 'hash' then
	holder = redis.call('hkeys', KEYS[1])[1] or false
end
return {redis.call('pttl', KEYS[1]), holder, redis.call('get', KEYS[2])}
`)

// redisLeaveQueue takes a waiter that gives up out of the line and, if
// the lock is free, announces it, so that the next waiter need not wait
// for its poll.
var redisLeaveQueue = redis.NewScript(`
redis.call('zrem', KEYS[1], ARGV[1])
redis.call('hdel', KEYS[2], ARGV[1])
if redis.call('exists', KEYS[3]) == 0 then
	redis.call('publish', KEYS[4], ARGV[2])
end
return 1
`)

// redisRenew extends the expiry only while the lock hash holds this
// grant's field (as Redisson's renewal does); 1 if it did.
var redisRenew = redis.NewScript(`
if redis.call('type', KEYS[1]).ok == 'hash' and redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
	redis.call('pexpire', KEYS[1], ARGV[1])
	return 1
end
return 0
`)

// redisRelease deletes the lock hash only while it holds this grant's
// field, and then announces the release on KEYS[2]; 1 if it deleted.
var redisRelease = redis.NewScript(`
if redis.call('type', KEYS[1]).ok == 'hash' and redis.call('hexists', KEYS[1], ARGV[1]) == 1 then
	redis.call('del', KEYS[1])
	redis.call('publish', KEYS[2], ARGV[2])
	return 1
end
return 0
`)

// redisSeed raises the counter to at least ARGV[1]; it returns the
// counter's value afterwards.
var redisSeed = redis.NewScript(`
local v = tonumber(redis.call('get', KEYS[1]) or '0')
if v == nil then
	return redis.error_reply('token counter ' .. KEYS[1] .. ' is not an integer')
end
local want = tonumber(ARGV[1])
if v < want then
	redis.call('set', KEYS[1], ARGV[1])
	return want
end
return v
`)

// DefaultPoll is Options.Poll's default.
const DefaultPoll = time.Second

// Options configures New.
type Options struct {
	// Poll bounds how long a waiter waits for a release announcement
	// before it tries again anyway (an announcement can be missed: a
	// holder's key that expires announces nothing, and a reconnecting
	// subscription misses messages), and how often a grant checks that
	// its key is still its own. Default DefaultPoll.
	Poll time.Duration
}

// Locker takes locks in Redis; it is a lock.Locker. Its methods are safe
// for concurrent use.
type Locker struct {
	cli  redis.UniversalClient
	poll time.Duration
}

// New returns a Locker that takes locks in Redis through cli: a
// *redis.Client, a *redis.ClusterClient, or a failover client. See the
// package documentation for the key layout and what Redis must be
// configured with for tokens to keep increasing.
func New(cli redis.UniversalClient, opts Options) *Locker {
	if opts.Poll <= 0 {
		opts.Poll = DefaultPoll
	}
	return &Locker{cli: cli, poll: opts.Poll}
}

// TokenKey returns the key of the token counter of the lock name:
// "redisson_lock_token:{NAME}", or "redisson_lock_token:NAME" when NAME
// has a hash tag of its own, so that the counter and the lock hash (the
// key NAME) are in one hash slot.
func TokenKey(name string) string { return redisPrefixName(redisTokenPrefix, name) }

// QueueKey returns the key of the line of waiters for the lock name, a
// sorted set in the lock's hash slot; the waiters' deadlines are a hash
// at the same key with "_deadline" appended to its prefix.
func QueueKey(name string) string { return redisPrefixName(redisQueuePrefix, name) }

// Channel returns the channel on which releases of the lock name are
// announced.
func Channel(name string) string { return redisPrefixName(redisChannelPrefix, name) }

// redisPrefixName is Redisson's RedissonObject.prefixName.
func redisPrefixName(prefix, name string) string {
	if strings.Contains(name, "{") {
		return prefix + ":" + name
	}
	return prefix + ":{" + name + "}"
}

// checkRedisName refuses names for which the lock hash and the counter
// could land in different Redis Cluster slots: a name with "{" but no
// non-empty "{…}" after its first "{" is hashed whole, and then the
// counter's key, a different string, hashes elsewhere.
func checkRedisName(name string) error {
	if name == "" {
		return errors.New("lock: empty name")
	}
	i := strings.IndexByte(name, '{')
	if i < 0 {
		return nil
	}
	j := strings.IndexByte(name[i+1:], '}')
	if j <= 0 {
		return fmt.Errorf("lock: Redis lock name %q has a \"{\" but no non-empty hash tag {...} after it; its token counter would hash to another cluster slot", name)
	}
	return nil
}

// Acquire takes the lock name, waiting while another holder has it until
// ctx is done. Waiters are served first come, first served: each joins a
// line (QueueKey) and takes the lock only from its head. A waiter keeps
// its place while it tries again at least every 3×Options.Poll; one that
// stops trying (a dead or stopped process) is dropped from the line, so it
// cannot block it. Waiters are woken by the release announcement, or try
// again after the holder's remaining TTL or Options.Poll, whichever is
// sooner. Redisson's RFencedLock does not know the line: a Redisson client
// takes a free lock ahead of our waiters (exclusion and the token sequence
// are not affected). The Grant is a *Lease.
func (r *Locker) Acquire(ctx context.Context, name string, opts lock.Options) (lock.Grant, error) {
	l, err := r.acquire(ctx, name, opts, true)
	if err != nil {
		return nil, err
	}
	return l, nil
}

// TryAcquire takes the lock name if it is free and no waiter of Acquire is
// in line for it, or returns a *lock.LockedError at once. The Grant is a
// *Lease.
func (r *Locker) TryAcquire(ctx context.Context, name string, opts lock.Options) (lock.Grant, error) {
	l, err := r.acquire(ctx, name, opts, false)
	if err != nil {
		return nil, err
	}
	return l, nil
}

func (r *Locker) acquire(ctx context.Context, name string, opts lock.Options, wait bool) (_ *Lease, err error) {
	if r == nil || r.cli == nil {
		return nil, errors.New("lock: nil Redis client")
	}
	if err := checkRedisName(name); err != nil {
		return nil, err
	}
	ttl := opts.TTL
	switch {
	case ttl < 0:
		return nil, fmt.Errorf("lock: negative TTL %v", ttl)
	case ttl == 0:
		ttl = lock.DefaultTTL
	case ttl < time.Millisecond:
		ttl = time.Millisecond
	}
	ttl = ttl.Round(time.Millisecond)
	field, err := redisHolderField(opts.HolderName())
	if err != nil {
		return nil, err
	}
	keys := []string{name, TokenKey(name), QueueKey(name), redisPrefixName(redisDeadlinePrefix, name)}
	mode, place := "try", 3*r.poll
	var sub *redis.PubSub
	if wait {
		// Subscribe before the first try, so that a release between a
		// failed try and the wait is not missed.
		sub = r.cli.Subscribe(ctx, Channel(name))
		defer sub.Close()
		if _, err := sub.Receive(ctx); err != nil {
			return nil, fmt.Errorf("lock: acquire %q: subscribe: %w", name, err)
		}
		mode = "wait"
		// However it ends without the lock, leave the line, so that the
		// next waiter need not wait for this one's place to lapse.
		defer func() {
			if err != nil {
				r.leaveQueue(name, keys, field)
			}
		}()
	}
	for {
		// The expiry is measured from before the request: Redis starts
		// its clock later, so the local deadline never falls after it.
		start := time.Now()
		res, err := redisAcquire.Run(ctx, r.cli, keys, ttl.Milliseconds(), field, mode, place.Milliseconds()).Slice()
		if err != nil {
			return nil, fmt.Errorf("lock: acquire %q: %w", name, err)
		}
		if len(res) < 2 {
			return nil, fmt.Errorf("lock: acquire %q: script returned %v", name, res)
		}
		if code, _ := res[0].(int64); code == -1 {
			token, ok := res[1].(int64)
			if !ok || token <= 0 {
				// Not a token fenced storage can use; leave the key to
				// expire rather than delete what we cannot vouch for.
				return nil, fmt.Errorf("lock: acquire %q: token counter %s gave %v", name, keys[1], res[1])
			}
			return r.newLease(name, field, token, ttl, start, opts.KeepAlive), nil
		}
		pttl, _ := res[0].(int64)
		if !wait {
			e := &lock.LockedError{Key: name, HolderKey: name}
			e.Holder, _ = res[1].(string)
			if len(res) > 2 {
				if s, ok := res[2].(string); ok {
					fmt.Sscan(s, &e.Token) //nolint:errcheck // informational
				}
			}
			return nil, e
		}
		// pttl is -1 for a key without expiry (not one of ours or
		// Redisson's) and -2 if it has just gone.
		d := r.poll
		if pttl >= 0 && time.Duration(pttl)*time.Millisecond < d {
			d = time.Duration(pttl)*time.Millisecond + time.Millisecond
		}
		if err := waitRelease(ctx, sub, d); err != nil {
			return nil, fmt.Errorf("lock: acquire %q: %w", name, err)
		}
	}
}

// leaveQueue takes field out of the line for name, with a context of its
// own: the caller's may be done. A failure is left to the place's
// deadline.
func (r *Locker) leaveQueue(name string, keys []string, field string) {
	ctx, cancel := context.WithTimeout(context.Background(), r.poll)
	defer cancel()
	_ = redisLeaveQueue.Run(ctx, r.cli, []string{keys[2], keys[3], name, Channel(name)}, field, redisUnlockMessage).Err()
}

// waitRelease waits up to d for a message on sub. Any message, a timeout
// or a broken subscription (go-redis reconnects it) ends the wait; only a
// done ctx is an error.
func waitRelease(ctx context.Context, sub *redis.PubSub, d time.Duration) error {
	_, err := sub.ReceiveTimeout(ctx, d)
	if cerr := ctx.Err(); cerr != nil {
		return cerr
	}
	var ne net.Error
	if err != nil && !errors.As(err, &ne) {
		// Not a timeout: back off a little before trying again.
		select {
		case <-time.After(min(d, 100*time.Millisecond)):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// redisHolderField is the hash field naming this grant: random, so that no
// two grants ever share one (Redisson re-enters a lock whose hash holds
// its own field), followed by the holder's name for operators.
func redisHolderField(holder string) (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("lock: %w", err)
	}
	return hex.EncodeToString(b[:]) + ":" + holder, nil
}

// SeedToken raises the token counter of the lock name to at least
// atLeast and returns the counter's value. After Redis lost the counter
// (a restart without persistence, a failover to a replica that missed the
// last increments, an eviction), seed it above the highest token the
// fenced database has seen, so that the next grant's token is larger
// than every earlier one. It never lowers the counter.
func (r *Locker) SeedToken(ctx context.Context, name string, atLeast int64) (int64, error) {
	if err := checkRedisName(name); err != nil {
		return 0, err
	}
	v, err := redisSeed.Run(ctx, r.cli, []string{TokenKey(name)}, atLeast).Int64()
	if err != nil {
		return 0, fmt.Errorf("lock: seed token of %q: %w", name, err)
	}
	return v, nil
}

func (r *Locker) newLease(name, field string, token int64, ttl time.Duration, start time.Time, keepAlive bool) *Lease {
	ctx, cancel := context.WithCancel(context.Background())
	l := &Lease{
		State:     held.New(name, token, cancel),
		r:         r,
		field:     field,
		ttl:       ttl,
		ctx:       ctx,
		monitored: make(chan struct{}),
		renewed:   make(chan time.Time),
	}
	go l.monitor(start.Add(ttl), keepAlive)
	return l
}

// Lease is one holder's grant of a Redis lock; it is a lock.Grant. Its
// methods are safe for concurrent use.
type Lease struct {
	*held.State // the name, the token and how the grant ended
	r           *Locker
	field       string
	ttl         time.Duration

	ctx       context.Context // canceled (by held.End) to stop the monitor
	monitored chan struct{}   // closed when the monitor has returned
	renewed   chan time.Time
}

// HolderField returns the field of the lock hash that names this grant.
func (l *Lease) HolderField() string { return l.field }

// TTL returns the expiry the lock key is given on each grant and renewal.
func (l *Lease) TTL() time.Duration { return l.ttl }

// Renew extends the lock key's expiry by TTL, only while the key still
// holds this grant; the counter is not touched. If the key is gone or
// another holder's, the grant ends and Renew returns its *lock.LostError.
func (l *Lease) Renew(ctx context.Context) error {
	if err := l.Err(); err != nil {
		return err
	}
	expiry, err := l.renew(ctx)
	if err != nil {
		return err
	}
	select {
	case l.renewed <- expiry:
	case <-l.Done():
		return l.Err()
	}
	return nil
}

// renew runs the renewal script; it returns the new local expiry, or the
// *lock.LostError after ending the grant when the key is no longer its own.
func (l *Lease) renew(ctx context.Context) (time.Time, error) {
	before := time.Now()
	ok, err := redisRenew.Run(ctx, l.r.cli, []string{l.Key()}, l.ttl.Milliseconds(), l.field).Int64()
	if err != nil {
		return time.Time{}, fmt.Errorf("lock: renew %q: %w", l.Key(), err)
	}
	if ok != 1 {
		held.Lost(l.State, "key %q no longer holds this grant", l.Key())
		return time.Time{}, l.Err()
	}
	return before.Add(l.ttl), nil
}

// Release deletes the lock key only if it still holds this grant, and
// announces the release to waiters; the counter is not touched. It
// returns lock.ErrNotHeld if the key had expired or was another holder's. The
// grant ends whatever the outcome; if Redis cannot be reached the key
// expires by itself.
func (l *Lease) Release(ctx context.Context) error {
	held.End(l.State, lock.ErrReleased)
	<-l.monitored
	n, err := redisRelease.Run(ctx, l.r.cli, []string{l.Key(), Channel(l.Key())}, l.field, redisUnlockMessage).Int64()
	switch {
	case err != nil:
		return fmt.Errorf("lock: release %q: %w", l.Key(), err)
	case n != 1:
		return fmt.Errorf("%w: lock %q, token %d", lock.ErrNotHeld, l.Key(), l.Token())
	}
	return nil
}

// monitor ends the grant when its local expiry passes, or when a check
// (with keepAlive, the renewal itself) finds the key is no longer its own.
func (l *Lease) monitor(expiry time.Time, keepAlive bool) {
	defer close(l.monitored)
	timer := time.NewTimer(time.Until(expiry))
	defer timer.Stop()
	every := min(l.r.poll, l.ttl/3)
	if every <= 0 {
		every = l.ttl
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-l.ctx.Done():
			return
		case <-timer.C:
			held.Lost(l.State, "lease expired after %v", l.ttl)
			return
		case e := <-l.renewed:
			if e.After(expiry) {
				expiry = e
				timer.Reset(time.Until(expiry))
			}
		case <-tick.C:
			cctx, cancel := context.WithTimeout(l.ctx, max(time.Until(expiry), time.Millisecond))
			if keepAlive {
				e, err := l.renew(cctx)
				if err == nil && e.After(expiry) {
					expiry = e
					timer.Reset(time.Until(expiry))
				}
			} else {
				l.check(cctx)
			}
			cancel()
			if l.Err() != nil {
				return
			}
		}
	}
}

// check ends the grant if the key no longer holds it; errors are left to
// the expiry timer.
func (l *Lease) check(ctx context.Context) {
	ok, err := l.r.cli.HExists(ctx, l.Key(), l.field).Result()
	if err == nil && !ok {
		held.Lost(l.State, "key %q no longer holds this grant", l.Key())
	} else if err != nil && strings.HasPrefix(err.Error(), "WRONGTYPE") {
		held.Lost(l.State, "key %q replaced", l.Key())
	}
}

// Check that Locker and Lease implement the lock interfaces.
var (
	_ lock.Locker = (*Locker)(nil)
	_ lock.Grant  = (*Lease)(nil)
)
