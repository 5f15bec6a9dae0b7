//go:build !linux

package proxy

import (
	"errors"
	"net"
	"time"
)

// The event loops wait with epoll (loop.go), which only Linux has. Built
// for another system the server starts none (pickLoop), and every session
// is relayed by a goroutine per direction, the path connections without a
// socket of their own take on Linux too (session.run). The types below
// only let the code that asks a session for its loop compile: no loop is
// ever made, so none of their methods is ever called.

// haveEventLoops reports whether the server relays sessions on event loops.
const haveEventLoops = false

var errNoEventLoops = errors.New("proxy: no event loops on this system")

type loop struct {
	now    time.Time
	yields int
}

type task struct{}

type loopConn struct {
	net.Conn
	fd int
}

var checkLoopThread = false

func newLoop() (*loop, error) { return nil, errNoEventLoops }

func detach(*loop, net.Conn) (*loopConn, error) { return nil, errNoEventLoops }

func (l *loop) onLoop() bool             { return false }
func (l *loop) inTask() bool             { return false }
func (l *loop) current() *task           { panic(errNoEventLoops) }
func (l *loop) post(func())              { panic(errNoEventLoops) }
func (l *loop) spawn(func(), func())     { panic(errNoEventLoops) }
func (l *loop) goTask(func())            { panic(errNoEventLoops) }
func (l *loop) makeReady(*task)          { panic(errNoEventLoops) }
func (l *loop) wake(*task)               { panic(errNoEventLoops) }
func (l *loop) sleep(time.Duration)      { panic(errNoEventLoops) }
func (l *loop) await(func())             { panic(errNoEventLoops) }
func (l *loop) register(*loopConn) error { return errNoEventLoops }
func (l *loop) stop()                    {}
func (t *task) park()                    { panic(errNoEventLoops) }
func (c *loopConn) release()             {}
