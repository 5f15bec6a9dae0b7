package proxy

// requests is a session's client-to-upstream direction: it reads the
// client's messages, has the policy decide on their statements, keeps the
// tracker's books of what it sends, and writes to the upstream. One
// goroutine (or the session's task on its event loop) runs it; the other
// direction, the server's answers to the client, and the session's
// lifecycle are the session's own.
type requests struct {
	*tracker
	// sess is the session, for its lifecycle (terminate, close).
	sess *session

	cr *msgReader  // client reader
	uw flushWriter // upstream writer
	// oidBuf is reused for the parameter types of the client's Parse
	// messages, up to maxReusedOIDs.
	oidBuf []uint32
}
