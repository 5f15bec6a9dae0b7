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
	// bindBuf is reused for the Binds the token is added to
	// (withTokenParam), up to maxReusedBind.
	bindBuf []byte
	// ownBuf is reused for the messages of the proxy's own statements
	// (sendOwn) and ownParams for holdAtBind's parameters, up to
	// maxReusedBind.
	ownBuf, ownParams []byte
	// live is the portal of a statement in the parameter form that was
	// bound and not yet executed (liveSet): it runs with the token of its
	// Bind, so the proxy closes it before any message that may run
	// something (closeLive). liveBind is its Bind (the client's, up to
	// maxKeptBind bytes, else nil) of liveStmt, defined as liveDef.
	live      string
	liveSet   bool
	liveBind  []byte
	liveStmt  string
	liveDef   *stmtDef
	liveDepth int    // the savepoint depth of its Bind (fenceRecord.saves)
	liveGen   uint64 // the rules generation of its Bind
	// closed is the portal closeLive closed last (closedSet), until a Bind
	// of that name; closedBind, closedStmt and closedDef are its live*.
	// Its Execute binds it again with the token then, if the server would
	// still have it (rebindClosed).
	closed     string
	closedSet  bool
	closedBind []byte
	closedStmt string
	closedDef  *stmtDef
	closedGen  uint64
}
