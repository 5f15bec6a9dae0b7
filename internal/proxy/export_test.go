package proxy

// LoopedSessions counts the server's sessions relayed by an event loop.
func LoopedSessions(s *Server) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for sess := range s.sessions {
		sess.mu.Lock()
		if sess.loop != nil {
			n++
		}
		sess.mu.Unlock()
	}
	return n
}

// SessionLoops counts the distinct event loops the server's sessions are
// on.
func SessionLoops(s *Server) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	loops := map[*loop]bool{}
	for sess := range s.sessions {
		sess.mu.Lock()
		if sess.loop != nil {
			loops[sess.loop] = true
		}
		sess.mu.Unlock()
	}
	return len(loops)
}

func init() {
	// Every wait on a loop checks that it runs on the loop's thread.
	checkLoopThread = true
}

// SetOffLoopCap replaces the bound on the work running off the loops at
// once (Server.offLoop). Call it before the first session: it holds s.mu,
// which every new session takes before it starts, so that the sessions see
// the new bound.
func SetOffLoopCap(s *Server, n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.offLoop = make(chan struct{}, n)
}

// LoopYields returns how many times the server's loops have passed through
// Go's scheduler (yieldEvery), read on each loop.
func LoopYields(s *Server) int {
	s.loopMu.Lock()
	loops := s.loops
	s.loopMu.Unlock()
	n := 0
	for _, l := range loops {
		ch := make(chan int, 1)
		l.post(func() { ch <- l.yields })
		n += <-ch
	}
	return n
}
