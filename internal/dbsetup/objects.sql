-- fenceproxy database objects, version 10. Installed by `fenceproxy setup`
-- in one transaction; every statement is idempotent.

CREATE SCHEMA IF NOT EXISTS fenceproxy;
GRANT USAGE ON SCHEMA fenceproxy TO PUBLIC;
-- No one else adds functions here (an overload could win a rewritten
-- statement's call of an error raiser).
REVOKE CREATE ON SCHEMA fenceproxy FROM PUBLIC;

-- Version of the objects below, for later upgrades.
CREATE TABLE IF NOT EXISTS fenceproxy.meta (
	key   text PRIMARY KEY,
	value text NOT NULL
);

-- The lock watermarks: for each lock name, the highest token registered.
-- Rows are never deleted by fenceproxy.
CREATE TABLE IF NOT EXISTS fenceproxy.locks (
	name       text PRIMARY KEY,
	token      bigint NOT NULL CHECK (token > 0),
	registered timestamptz NOT NULL DEFAULT pg_catalog.now()
);
REVOKE ALL ON fenceproxy.meta, fenceproxy.locks FROM PUBLIC;
GRANT SELECT ON fenceproxy.meta, fenceproxy.locks TO PUBLIC;
-- The lock names again, under the "C" collation (version 10): hold,
-- hold_at and rehold_at, a registration's common case, find the watermark
-- by this index, whose
-- comparisons are of bytes, where the primary key's are the database's
-- collation's (strcoll, or ICU's), several times the cost. Equality is
-- the same under both (a database's default collation is deterministic),
-- so the index is unique exactly when the key is.
CREATE UNIQUE INDEX IF NOT EXISTS locks_name_c ON fenceproxy.locks (name COLLATE "C");

-- register(lock_setting, token_setting, required, audit, tag, tables)
-- registers the session's token for the session's lock, for the rest of
-- the current transaction. The proxy calls it before every statement that
-- reads or writes a lock-fenced table, in the same transaction.
--
--   - No lock name set: nothing, unless required (then FP002).
--   - Lock name set, token invalid: FP002 if required; otherwise nothing
--     (row fencing decides what a write without a token does).
--   - The lock's watermark is newer than the token: FP001.
--   - Equal: a shared advisory lock on the lock name until the transaction
--     ends, so that no newer token can register meanwhile (sessions of the
--     same token do not wait for each other).
--   - Older or absent: an exclusive advisory lock (waiting for the
--     transactions of older tokens to end), then the watermark becomes the
--     token.
--
-- With audit true (every lock-fenced table of the statement in audit
-- mode) nothing fails: what would have failed is reported with pg_notify
-- on fenceproxy_audit, and the watermark still moves forward.
--
-- Under REPEATABLE READ and SERIALIZABLE the transaction's snapshot may be
-- older than the lock's state: a wait for another holder, or a watermark
-- changed since the snapshot, fails with 40001 (serialization_failure) so
-- that the client retries the whole transaction.
--
-- Version 4 made it cheaper for the server (callgrind, a simple-protocol
-- CALL in its own transaction: 200k instructions in version 3, 174k, of
-- which ~57k are what a CALL of an empty procedure costs): PL/pgSQL
-- prepares each expression of a function once per transaction and runs
-- each statement that is not a plain expression as a query, so the
-- common path (a lock name, a valid token of up to 18 digits, the
-- watermark equal to it) evaluates as few expressions as it can: the
-- lock name and token checked in one test, the rare cases behind it;
-- void functions called in assignments, which PL/pgSQL evaluates as
-- expressions, where PERFORM runs a query.
CREATE OR REPLACE PROCEDURE fenceproxy.register(
	lock_setting text, token_setting text, required boolean, audit boolean,
	tag text, tables text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $body$
DECLARE
	lk text := current_setting(lock_setting, true);
	tk text := current_setting(token_setting, true);
	digits text;
	tok bigint;
	w bigint;
	v text;
BEGIN
	-- The common case first: a lock name of 1 to 1024 bytes and a token of
	-- up to 18 significant digits (all in range).
	IF octet_length(lk) BETWEEN 1 AND 1024 AND tk ~ '^0*[1-9][0-9]{0,17}$' THEN
		tok := tk::bigint;
	ELSE
		IF lk IS NULL OR lk = '' THEN
			IF required THEN
				IF audit THEN
					PERFORM pg_notify('fenceproxy_audit', json_build_object('v', 1, 'i', tag, 'm', 'audit',
						'r', 'missing_lock', 't', tables, 'l', NULL, 'tok', substr(tk, 1, 32), 'w', NULL)::text);
					RETURN;
				END IF;
				RAISE EXCEPTION USING ERRCODE = 'FP002',
					MESSAGE = format('fenceproxy: no lock name: set %s to the name of the lock you hold (table %s requires one)', lock_setting, tables),
					HINT = format('SET %s = ''<lock name>''; SET %s = ''<token>'';', lock_setting, token_setting);
			END IF;
			RETURN;
		END IF;
		IF octet_length(lk) > 1024 THEN
			IF audit THEN
				PERFORM pg_notify('fenceproxy_audit', json_build_object('v', 1, 'i', tag, 'm', 'audit',
					'r', 'missing_lock', 't', tables, 'l', substr(lk, 1, 256), 'tok', substr(tk, 1, 32), 'w', NULL)::text);
				RETURN;
			END IF;
			RAISE EXCEPTION USING ERRCODE = 'FP002',
				MESSAGE = format('fenceproxy: the lock name in %s is longer than 1024 bytes', lock_setting);
		END IF;
		digits := ltrim(tk, '0');
		IF tk IS NULL OR tk !~ '^[0-9]+$' OR digits = '' OR length(digits) > 19
				OR (length(digits) = 19 AND digits COLLATE "C" > '9223372036854775807') THEN
			IF required THEN
				IF audit THEN
					PERFORM pg_notify('fenceproxy_audit', json_build_object('v', 1, 'i', tag, 'm', 'audit',
						'r', 'missing_token', 't', tables, 'l', substr(lk, 1, 256), 'tok', substr(tk, 1, 32), 'w', NULL)::text);
					RETURN;
				END IF;
				RAISE EXCEPTION USING ERRCODE = 'FP002',
					MESSAGE = format('fenceproxy: lock %s is set but %s is not a valid fencing token (%s)',
						quote_literal(substr(lk, 1, 256)), token_setting, coalesce(quote_literal(substr(tk, 1, 32)), 'unset')),
					HINT = 'A token is a decimal integer from 1 to 9223372036854775807.';
			END IF;
			RETURN;
		END IF;
		tok := digits::bigint;
	END IF;

	-- Every path that finds the watermark newer than the token leaves this
	-- block for the one stale branch below it. Watermarks only grow: stale
	-- now means stale after any wait. The advisory locks are fenceproxy's
	-- class 1179667531 ('FPLK') and the lock name's hash.
	<<register>>
	BEGIN
		SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name = lk;
		IF w = tok THEN
			-- The common case: the token is the lock's watermark. Hold it
			-- shared, then read again: a newer holder may have registered
			-- while we waited.
			IF current_setting('transaction_isolation') = 'read committed' THEN
				v := pg_advisory_xact_lock_shared(1179667531, hashtext(lk))::text;
				SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name = lk;
			ELSE
				IF NOT pg_try_advisory_xact_lock_shared(1179667531, hashtext(lk)) THEN
					v := pg_advisory_xact_lock_shared(1179667531, hashtext(lk))::text;
					RAISE EXCEPTION USING ERRCODE = '40001',
						MESSAGE = format('fenceproxy: could not serialize access: lock %s changed hands during this transaction', quote_literal(substr(lk, 1, 256)));
				END IF;
				-- FOR SHARE fails with 40001 if the watermark changed after
				-- the transaction's snapshot.
				SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name = lk FOR SHARE;
			END IF;
			EXIT register WHEN w > tok;
		ELSE
			EXIT register WHEN w > tok;
		END IF;
		-- Checked again after the equal case: the watermark may have been
		-- lowered or deleted by hand while we waited; it is restored.
		IF w IS NULL OR w < tok THEN
			-- A newer token (or the lock's first): wait for the
			-- transactions that registered older tokens, then move the
			-- watermark.
			IF current_setting('transaction_isolation') = 'read committed' THEN
				v := pg_advisory_xact_lock(1179667531, hashtext(lk))::text;
			ELSIF NOT pg_try_advisory_xact_lock(1179667531, hashtext(lk)) THEN
				v := pg_advisory_xact_lock(1179667531, hashtext(lk))::text;
				RAISE EXCEPTION USING ERRCODE = '40001',
					MESSAGE = format('fenceproxy: could not serialize access: lock %s was in use by an older holder', quote_literal(substr(lk, 1, 256)));
			END IF;
			SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name = lk FOR UPDATE;
			IF NOT FOUND THEN
				INSERT INTO fenceproxy.locks AS l (name, token) VALUES (lk, tok)
					ON CONFLICT (name) DO UPDATE SET token = excluded.token, registered = pg_catalog.now()
					WHERE l.token < excluded.token;
			ELSE
				EXIT register WHEN w > tok;
				IF w < tok THEN
					UPDATE fenceproxy.locks SET token = tok, registered = pg_catalog.now() WHERE name = lk;
				END IF;
			END IF;
		END IF;
		-- Registered. Tells the database guard's triggers that this
		-- transaction registered (they would call this procedure again
		-- otherwise).
		v := set_config('fenceproxy.guard_registered', lk || E'\n' || tok, true);
		RETURN;
	END;

	-- Stale: a newer holder of the lock has registered.
	IF audit THEN
		PERFORM pg_notify('fenceproxy_audit', json_build_object('v', 1, 'i', tag, 'm', 'audit',
			'r', 'stale_lock', 't', tables, 'l', substr(lk, 1, 256), 'tok', tok::text, 'w', w)::text);
		RETURN;
	END IF;
	RAISE EXCEPTION USING ERRCODE = 'FP001',
		MESSAGE = format('fenceproxy: stale token %s for lock %s: the lock''s watermark is %s', tok, quote_literal(substr(lk, 1, 256)), w),
		DETAIL = format('lock=%s token=%s watermark=%s', quote_literal(substr(lk, 1, 256)), tok, w),
		HINT = 'A newer holder of the lock has registered: stop, acquire the lock again and re-read.';
END
$body$;
REVOKE ALL ON PROCEDURE fenceproxy.register(text, text, boolean, boolean, text, text) FROM PUBLIC;
GRANT EXECUTE ON PROCEDURE fenceproxy.register(text, text, boolean, boolean, text, text) TO PUBLIC;

-- hold(lock_setting, token_setting, required, audit, tag, tables) is what
-- proxies of objects version 6 and later call in place of register: the
-- same arguments and the same outcome in every case, at a lower cost in
-- the common one (a lock name, a token of up to 18 digits, READ
-- COMMITTED, the watermark equal to the token), which is nearly every
-- registration: the watermark read, held shared, read again, as register
-- does, in a procedure that runs with the caller's rights and sets no
-- search_path (register's SECURITY DEFINER and SET search_path switch the
-- user and the settings around every call: hold saves about a tenth of a
-- registration's instructions). It only reads (fenceproxy.locks is
-- readable by PUBLIC, by the index locks_name_c since version 10); every
-- other case is register's, which it calls, and the watermark moves in
-- register only. With no search_path of its
-- own, every name is qualified, operators and types too (PL/pgSQL
-- resolves a type name of the body on the caller's search_path, where
-- pg_temp comes before pg_catalog), so that the caller's search_path
-- cannot change what it runs.
CREATE OR REPLACE PROCEDURE fenceproxy.hold(
	lock_setting text, token_setting text, required boolean, audit boolean,
	tag text, tables text)
LANGUAGE plpgsql
AS $hold$
DECLARE
	lk pg_catalog.text := pg_catalog.current_setting(lock_setting, true);
	tk pg_catalog.text := pg_catalog.current_setting(token_setting, true);
	tok pg_catalog.int8;
	w pg_catalog.int8;
	v pg_catalog.text;
BEGIN
	IF pg_catalog.octet_length(lk) OPERATOR(pg_catalog.>) 0
			AND pg_catalog.octet_length(lk) OPERATOR(pg_catalog.<=) 1024
			AND pg_catalog.octet_length(tk) OPERATOR(pg_catalog.>) 0
			AND pg_catalog.octet_length(tk) OPERATOR(pg_catalog.<=) 18
			AND pg_catalog.ltrim(tk, '0123456789') OPERATOR(pg_catalog.=) ''
			AND pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.=) 'read committed' THEN
		tok := tk::pg_catalog.int8;
		SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name COLLATE pg_catalog."C" OPERATOR(pg_catalog.=) lk;
		IF w OPERATOR(pg_catalog.=) tok THEN
			-- Held shared, then read again: a newer holder may have
			-- registered while we waited (each read of a procedure that
			-- is not STABLE takes a new snapshot under READ COMMITTED).
			v := pg_catalog.pg_advisory_xact_lock_shared(1179667531, pg_catalog.hashtext(lk))::pg_catalog.text;
			SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name COLLATE pg_catalog."C" OPERATOR(pg_catalog.=) lk;
			IF w OPERATOR(pg_catalog.=) tok THEN
				v := pg_catalog.set_config('fenceproxy.guard_registered', lk OPERATOR(pg_catalog.||) E'\n' OPERATOR(pg_catalog.||) tok::pg_catalog.text, true);
				RETURN;
			END IF;
		END IF;
	END IF;
	-- Not the common case, or the watermark moved while we waited (newer:
	-- register raises FP001; lowered or deleted by hand: register restores
	-- it, as after its own wait).
	CALL fenceproxy.register(lock_setting, token_setting, required, audit, tag, tables);
END
$hold$;
REVOKE ALL ON PROCEDURE fenceproxy.hold(text, text, boolean, boolean, text, text) FROM PUBLIC;
GRANT EXECUTE ON PROCEDURE fenceproxy.hold(text, text, boolean, boolean, text, text) TO PUBLIC;

-- enter(token_setting, token, lock_setting, lock, want, register,
-- required, audit, tag, tables) is what proxies of objects version 7 and
-- later send before a statement of the extended protocol on a protected
-- table, in place of three statements of their own: it sets the session's
-- fence settings for the transaction (set_config(..., true), the token
-- setting first), runs the catalog check for stamp want (unless want is
-- NULL) and registers (hold, with the last six arguments, if register is
-- true), in that order, as the three statements did. Each statement the
-- proxy adds costs the server its parse, plan and messages whatever it
-- does (about a sixth of a one-row UPDATE's throughput here, measured in
-- docs/benchmarks.md): one call in place of three saves two. The check's
-- common case is catalog_at's first statement, written as there (a test
-- compares them; calling catalog_at for it costs up to a tenth more),
-- and catalog_at decides every other case. It runs with the caller's
-- rights and sets no search_path; every name in it is qualified, so that
-- the caller's search_path cannot change what it runs, and its errors are
-- those of the procedures it calls.
CREATE OR REPLACE PROCEDURE fenceproxy.enter(
	token_setting text, token text, lock_setting text, lock text, want bigint,
	register boolean, required boolean, audit boolean, tag text, tables text)
LANGUAGE plpgsql
AS $enter$
DECLARE
	v pg_catalog.text;
BEGIN
	v := pg_catalog.set_config(token_setting, token, true);
	v := pg_catalog.set_config(lock_setting, lock, true);
	IF want IS NOT NULL THEN
		PERFORM FROM fenceproxy.catalog c
			WHERE c.stamp OPERATOR(pg_catalog.=) want AND c.xmax OPERATOR(pg_catalog.=) '0'::pg_catalog.xid
				AND (c.writer OPERATOR(pg_catalog.=) pg_catalog.txid_current_if_assigned()) IS NOT TRUE;
		IF NOT FOUND THEN
			CALL fenceproxy.catalog_at(want);
		END IF;
	END IF;
	IF register THEN
		CALL fenceproxy.hold(lock_setting, token_setting, required, audit, tag, tables);
	END IF;
END
$enter$;
REVOKE ALL ON PROCEDURE fenceproxy.enter(text, text, text, text, bigint, boolean, boolean, boolean, text, text) FROM PUBLIC;
GRANT EXECUTE ON PROCEDURE fenceproxy.enter(text, text, text, text, bigint, boolean, boolean, boolean, text, text) TO PUBLIC;

-- hold_at(want, lock, token, rest) is what proxies of objects version 8
-- and later send in front of a simple Query that registers one lock, in
-- place of the two SET LOCALs of the session's fence settings, the
-- catalog check and the call of hold, where nothing else in the
-- transaction reads the settings: the catalog check for stamp want
-- (catalog_at's first statement, written as there, as in enter; a test
-- compares them), then hold's common case (written as there; a test
-- compares them too) with the lock and the token given as values, not
-- read from the settings. Every other case is register's, which it
-- calls with the settings set transaction-locally to those values (what
-- the SET LOCALs did), so the outcome, errors and audit records are
-- register's. rest holds register's other arguments, one per line: the
-- token setting's name, the lock setting's name, required and audit
-- ('t' or 'f'), the audit tag and the table list (the rest of the text,
-- which may hold line breaks); each argument of a CALL costs the server
-- about as much as a line of the body, so the common case reads one. It
-- runs with the caller's rights and sets no search_path; every name in
-- it is qualified. Its reads of the watermark, hold's, use the index
-- locks_name_c (version 10).
CREATE OR REPLACE PROCEDURE fenceproxy.hold_at(want bigint, lk text, tk text, rest text)
LANGUAGE plpgsql
AS $hold_at$
DECLARE
	tok pg_catalog.int8;
	w pg_catalog.int8;
	v pg_catalog.text;
	a pg_catalog.text[];
BEGIN
	PERFORM FROM fenceproxy.catalog c
		WHERE c.stamp OPERATOR(pg_catalog.=) want AND c.xmax OPERATOR(pg_catalog.=) '0'::pg_catalog.xid
			AND (c.writer OPERATOR(pg_catalog.=) pg_catalog.txid_current_if_assigned()) IS NOT TRUE;
	IF NOT FOUND THEN
		CALL fenceproxy.catalog_at(want);
	END IF;
	IF pg_catalog.octet_length(lk) OPERATOR(pg_catalog.>) 0
			AND pg_catalog.octet_length(lk) OPERATOR(pg_catalog.<=) 1024
			AND pg_catalog.octet_length(tk) OPERATOR(pg_catalog.>) 0
			AND pg_catalog.octet_length(tk) OPERATOR(pg_catalog.<=) 18
			AND pg_catalog.ltrim(tk, '0123456789') OPERATOR(pg_catalog.=) ''
			AND pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.=) 'read committed' THEN
		tok := tk::pg_catalog.int8;
		SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name COLLATE pg_catalog."C" OPERATOR(pg_catalog.=) lk;
		IF w OPERATOR(pg_catalog.=) tok THEN
			-- Held shared, then read again: a newer holder may have
			-- registered while we waited (each read of a procedure that
			-- is not STABLE takes a new snapshot under READ COMMITTED).
			v := pg_catalog.pg_advisory_xact_lock_shared(1179667531, pg_catalog.hashtext(lk))::pg_catalog.text;
			SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name COLLATE pg_catalog."C" OPERATOR(pg_catalog.=) lk;
			IF w OPERATOR(pg_catalog.=) tok THEN
				v := pg_catalog.set_config('fenceproxy.guard_registered', lk OPERATOR(pg_catalog.||) E'\n' OPERATOR(pg_catalog.||) tok::pg_catalog.text, true);
				RETURN;
			END IF;
		END IF;
	END IF;
	-- Not the common case, or the watermark moved while we waited:
	-- register decides, reading the values from the settings.
	a := pg_catalog.string_to_array(rest, E'\n');
	IF a IS NULL OR pg_catalog.cardinality(a) OPERATOR(pg_catalog.<) 6 THEN
		RAISE EXCEPTION 'fenceproxy.hold_at: rest holds % lines, not 6', pg_catalog.cardinality(a);
	END IF;
	v := pg_catalog.set_config(a[1], tk, true);
	v := pg_catalog.set_config(a[2], lk, true);
	CALL fenceproxy.register(a[2], a[1], a[3]::pg_catalog.bool, a[4]::pg_catalog.bool, a[5],
		pg_catalog.array_to_string(a[6:], E'\n'));
END
$hold_at$;
REVOKE ALL ON PROCEDURE fenceproxy.hold_at(bigint, text, text, text) FROM PUBLIC;
GRANT EXECUTE ON PROCEDURE fenceproxy.hold_at(bigint, text, text, text) TO PUBLIC;

-- rehold_at(want, lock, token, rest) is hold_at for a session that has
-- registered this token for this lock before, in a transaction that
-- committed (version 9): the watermark is then at least the token, since
-- watermarks only grow, so the registration never needs the lock
-- exclusively and may take it shared before it reads the watermark, once,
-- where hold_at reads it on both sides of the lock (it must know first
-- whether it will need the lock exclusively: taking it shared first would
-- let two sessions of a new holder each hold it shared and wait for the
-- other to let go). The catalog check first, as in hold_at (a test
-- compares them); then, under READ COMMITTED, the lock shared and the
-- watermark read after it: equal to the token as the session gave it (its
-- decimal text), and the registration holds. Every other case calls
-- hold_at, so it is register's: a stale token is refused there without a
-- wait; a watermark below the token (the proxy's memory of the commit
-- wrong: a watermark lowered or deleted by hand, a commit lost in a
-- failover, or undone by stored code the proxy did not see) goes on to
-- register, which takes the lock exclusively while this transaction
-- holds it shared, only where no other session holds it (a try); else
-- the statement fails with FP003, and its retry goes through hold_at
-- (the proxy forgets a registration that failed): two such sessions never
-- wait for each other. Its read compares the names byte by byte, by the
-- index locks_name_c (version 10; a test checks the plan). It sets no
-- guard memo: the proxy calls it only where
-- no database guard is installed (one installed since is found by the
-- catalog check, or its trigger finds no memo and registers, which fails
-- without the settings). Caller's rights, no search_path, every name
-- qualified.
CREATE OR REPLACE PROCEDURE fenceproxy.rehold_at(want bigint, lk text, tk text, rest text)
LANGUAGE plpgsql
AS $rehold_at$
DECLARE
	w pg_catalog.int8;
	v pg_catalog.text;
BEGIN
	PERFORM FROM fenceproxy.catalog c
		WHERE c.stamp OPERATOR(pg_catalog.=) want AND c.xmax OPERATOR(pg_catalog.=) '0'::pg_catalog.xid
			AND (c.writer OPERATOR(pg_catalog.=) pg_catalog.txid_current_if_assigned()) IS NOT TRUE;
	IF NOT FOUND THEN
		CALL fenceproxy.catalog_at(want);
	END IF;
	IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.=) 'read committed' THEN
		v := pg_catalog.pg_advisory_xact_lock_shared(1179667531, pg_catalog.hashtext(lk))::pg_catalog.text;
		SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name COLLATE pg_catalog."C" OPERATOR(pg_catalog.=) lk;
		IF w::pg_catalog.text OPERATOR(pg_catalog.=) tk THEN
			RETURN;
		END IF;
		-- Below the token (lowered or deleted by hand, or a commit lost
		-- in a failover): register would take the lock exclusively while
		-- this transaction holds it shared, and two such sessions would
		-- wait for each other. It goes on only where no other session
		-- holds the lock; otherwise the statement is refused for a retry,
		-- which the proxy sends through hold_at.
		IF pg_catalog.octet_length(tk) OPERATOR(pg_catalog.>) 0
				AND pg_catalog.octet_length(tk) OPERATOR(pg_catalog.<=) 18
				AND pg_catalog.ltrim(tk, '0123456789') OPERATOR(pg_catalog.=) '' THEN
			IF w IS NULL OR w OPERATOR(pg_catalog.<) tk::pg_catalog.int8 THEN
				IF NOT pg_catalog.pg_try_advisory_xact_lock(1179667531, pg_catalog.hashtext(lk)) THEN
					RAISE EXCEPTION USING ERRCODE = 'FP003',
						MESSAGE = 'fenceproxy: the watermark of this lock is below the token this session registered before; the statement did not run',
						HINT = 'Retry it.';
				END IF;
			END IF;
		END IF;
	END IF;
	-- Not the common case: hold_at's, which ends in register (its check
	-- of the catalog passes now, and a shared lock held twice is held).
	CALL fenceproxy.hold_at(want, lk, tk, rest);
END
$rehold_at$;
REVOKE ALL ON PROCEDURE fenceproxy.rehold_at(bigint, text, text, text) FROM PUBLIC;
GRANT EXECUTE ON PROCEDURE fenceproxy.rehold_at(bigint, text, text, text) TO PUBLIC;

-- The error raisers of the rewritten statements (version 2). A rewritten
-- write calls them only in the CASE branch of a stale row or an invalid
-- token; on the common path they cost the server one function lookup while
-- the statement is analysed, where the inline form (a marker text cast to
-- bigint, built with || and quote_nullable) costs it the analysis of a
-- dozen operators and casts. The proxy uses them in a database once its
-- check finds them current and callable by PUBLIC; until then it writes
-- the inline form.
--
-- Each raises its fenceproxy SQLSTATE with the marker text as the message
-- (the grammar in rules/errors.go), which the proxy turns into the error the
-- client sees, exactly as it does the inline form's 22P02.
--
-- STABLE: PostgreSQL never evaluates them ahead of need (they are called
-- in a CASE branch that depends on a column or on the token setting), a
-- conjunct calling them stays a one-time filter, and they may run in
-- parallel workers. Not SECURITY DEFINER, no SET search_path (it would cost
-- every call a GUC save and restore): they run with the caller's rights,
-- and every function, operator and type in them is qualified.
--
-- stale(token_setting, fence, sized_table) raises FP001
--   "fenceproxy:stale:<token>:<fence>:<sized_table>" and returns bigint;
--   stale_b, for boolean places, calls it.
-- no_token(token_setting, sized_names) raises FP002
--   "fenceproxy:token:<sized_names><quote_nullable(token)>" and returns
--   bigint; no_token_b, for boolean places, calls it.
CREATE OR REPLACE FUNCTION fenceproxy.stale(token_setting text, fence bigint, sized_table text)
RETURNS bigint LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $stale$
BEGIN
	RAISE EXCEPTION USING ERRCODE = 'FP001', MESSAGE = 'fenceproxy:stale:'
		OPERATOR(pg_catalog.||) COALESCE(pg_catalog.current_setting(token_setting, true), '')
		OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) COALESCE(fence::pg_catalog.text, '')
		OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) sized_table;
END
$stale$;
CREATE OR REPLACE FUNCTION fenceproxy.stale_b(token_setting text, fence bigint, sized_table text)
RETURNS boolean LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $stale_b$
BEGIN
	PERFORM fenceproxy.stale(token_setting, fence, sized_table);
	RETURN NULL; -- not reached: stale raises
END
$stale_b$;
CREATE OR REPLACE FUNCTION fenceproxy.no_token(token_setting text, sized_names text)
RETURNS bigint LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $no_token$
BEGIN
	RAISE EXCEPTION USING ERRCODE = 'FP002', MESSAGE = 'fenceproxy:token:'
		OPERATOR(pg_catalog.||) sized_names
		OPERATOR(pg_catalog.||) pg_catalog.quote_nullable(pg_catalog.current_setting(token_setting, true));
END
$no_token$;
CREATE OR REPLACE FUNCTION fenceproxy.no_token_b(token_setting text, sized_names text)
RETURNS boolean LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $no_token_b$
BEGIN
	PERFORM fenceproxy.no_token(token_setting, sized_names);
	RETURN NULL; -- not reached: no_token raises
END
$no_token_b$;

-- Version 3: the checks themselves, so that a rewritten statement carries
-- one call where it carried a token read, a validation and a CASE. The
-- server analyses and plans the statement's expressions every time it is
-- sent (simple protocol); a PL/pgSQL function's expressions are prepared
-- once per session. Measured with callgrind, a fenced UPDATE costs the
-- server about 30 % fewer instructions than with the version 2 forms
-- (docs/benchmarks.md).
--
-- A token is valid when it matches the pattern the inline form uses
-- (rules.TokenPattern), exactly the decimal strings of 1..2^63-1. They
-- try a short pattern first, up to 18 significant digits, which are all in
-- range: the full pattern's twenty alternatives cost PostgreSQL's regular
-- expression engine about 20k instructions a match, the short one a
-- third of it, and only larger (or invalid) tokens need the full one.
--
-- tok(token_setting, sized_names) returns the session's token as bigint,
--   or raises FP002 as no_token does when it is not valid (the fence value
--   of a new row); tok_b returns true or raises (the one-time WHERE
--   conjunct that fails a statement without a valid token before it reads
--   a row). tok_b and advance repeat tok's test rather than calling
--   it: a nested PL/pgSQL call costs ~9k instructions more per call
--   (callgrind; 3-4 % of a fenced UPDATE, 6-8 % of a prepared one's
--   execution). TestRaisersPattern checks that the three tests agree.
-- advance(token_setting, fence, strict, sized_table, sized_names) returns
--   the token when the row's fence is older (or equal, unless strict),
--   raises FP001 as stale does when it is newer (or NULL), and FP002 as
--   no_token does when the token is not valid: the new fence value of an
--   updated row in on_stale: error mode.
--
-- tok and tok_b are called with constant arguments, where STABLE is what
-- keeps PostgreSQL from computing them once, when the statement is planned
-- (as it does IMMUTABLE functions of constants): a prepared statement would
-- keep the token it was planned with. The check requires every raiser to
-- be declared exactly as here (STABLE, not STRICT, no SECURITY DEFINER, no
-- settings).
CREATE OR REPLACE FUNCTION fenceproxy.tok(token_setting text, sized_names text)
RETURNS bigint LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $tok$
DECLARE
	tk pg_catalog.text := pg_catalog.current_setting(token_setting, true);
BEGIN
	IF tk OPERATOR(pg_catalog.~) '^0*[1-9][0-9]{0,17}$' OR tk OPERATOR(pg_catalog.~) '^0*([1-9][0-9]{0,17}|[1-8][0-9]{18}|9[0-1][0-9]{17}|92[0-1][0-9]{16}|922[0-2][0-9]{15}|9223[0-2][0-9]{14}|92233[0-6][0-9]{13}|922337[0-1][0-9]{12}|92233720[0-2][0-9]{10}|922337203[0-5][0-9]{9}|9223372036[0-7][0-9]{8}|92233720368[0-4][0-9]{7}|922337203685[0-3][0-9]{6}|9223372036854[0-6][0-9]{5}|92233720368547[0-6][0-9]{4}|922337203685477[0-4][0-9]{3}|9223372036854775[0-7][0-9]{2}|922337203685477580[0-6]|9223372036854775807)$' THEN
		RETURN tk::pg_catalog.int8;
	END IF;
	RETURN fenceproxy.no_token(token_setting, sized_names);
END
$tok$;
CREATE OR REPLACE FUNCTION fenceproxy.tok_b(token_setting text, sized_names text)
RETURNS boolean LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $tok_b$
DECLARE
	tk pg_catalog.text := pg_catalog.current_setting(token_setting, true);
BEGIN
	IF tk OPERATOR(pg_catalog.~) '^0*[1-9][0-9]{0,17}$' OR tk OPERATOR(pg_catalog.~) '^0*([1-9][0-9]{0,17}|[1-8][0-9]{18}|9[0-1][0-9]{17}|92[0-1][0-9]{16}|922[0-2][0-9]{15}|9223[0-2][0-9]{14}|92233[0-6][0-9]{13}|922337[0-1][0-9]{12}|92233720[0-2][0-9]{10}|922337203[0-5][0-9]{9}|9223372036[0-7][0-9]{8}|92233720368[0-4][0-9]{7}|922337203685[0-3][0-9]{6}|9223372036854[0-6][0-9]{5}|92233720368547[0-6][0-9]{4}|922337203685477[0-4][0-9]{3}|9223372036854775[0-7][0-9]{2}|922337203685477580[0-6]|9223372036854775807)$' THEN
		RETURN true;
	END IF;
	PERFORM fenceproxy.no_token(token_setting, sized_names);
	RETURN NULL; -- not reached: no_token raises
END
$tok_b$;
CREATE OR REPLACE FUNCTION fenceproxy.advance(token_setting text, fence bigint, strict boolean,
	sized_table text, sized_names text)
RETURNS bigint LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $advance$
DECLARE
	tk pg_catalog.text := pg_catalog.current_setting(token_setting, true);
	t pg_catalog.int8;
BEGIN
	IF tk OPERATOR(pg_catalog.~) '^0*[1-9][0-9]{0,17}$' OR tk OPERATOR(pg_catalog.~) '^0*([1-9][0-9]{0,17}|[1-8][0-9]{18}|9[0-1][0-9]{17}|92[0-1][0-9]{16}|922[0-2][0-9]{15}|9223[0-2][0-9]{14}|92233[0-6][0-9]{13}|922337[0-1][0-9]{12}|92233720[0-2][0-9]{10}|922337203[0-5][0-9]{9}|9223372036[0-7][0-9]{8}|92233720368[0-4][0-9]{7}|922337203685[0-3][0-9]{6}|9223372036854[0-6][0-9]{5}|92233720368547[0-6][0-9]{4}|922337203685477[0-4][0-9]{3}|9223372036854775[0-7][0-9]{2}|922337203685477580[0-6]|9223372036854775807)$' THEN
		t := tk::pg_catalog.int8;
		IF fence OPERATOR(pg_catalog.<) t OR (fence OPERATOR(pg_catalog.=) t AND NOT strict) THEN
			RETURN t;
		END IF;
		RETURN fenceproxy.stale(token_setting, fence, sized_table);
	END IF;
	RETURN fenceproxy.no_token(token_setting, sized_names);
END
$advance$;
-- Version 5: stale_at(fence) raises FP001 "fenceproxy:stale_at:<fence>"
--   and returns bigint; stale_at_b, for boolean places, calls it. The
--   token form of a simple Query (the session's token written into the
--   statement by the proxy) calls it in place of stale: the proxy knows
--   the token and the table of the statement it sent and fills them into
--   the error, and the call's two constant arguments cost the server
--   about 8k instructions of analysis in every fenced statement sent,
--   stale row or not (docs/benchmarks.md).
CREATE OR REPLACE FUNCTION fenceproxy.stale_at(fence bigint)
RETURNS bigint LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $stale_at$
BEGIN
	RAISE EXCEPTION USING ERRCODE = 'FP001', MESSAGE = 'fenceproxy:stale_at:'
		OPERATOR(pg_catalog.||) COALESCE(fence::pg_catalog.text, '');
END
$stale_at$;
CREATE OR REPLACE FUNCTION fenceproxy.stale_at_b(fence bigint)
RETURNS boolean LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $stale_at_b$
BEGIN
	PERFORM fenceproxy.stale_at(fence);
	RETURN NULL; -- not reached: stale_at raises
END
$stale_at_b$;
GRANT EXECUTE ON FUNCTION fenceproxy.stale(text, bigint, text), fenceproxy.stale_b(text, bigint, text),
	fenceproxy.no_token(text, text), fenceproxy.no_token_b(text, text),
	fenceproxy.tok(text, text), fenceproxy.tok_b(text, text),
	fenceproxy.advance(text, bigint, boolean, text, text),
	fenceproxy.stale_at(bigint), fenceproxy.stale_at_b(bigint) TO PUBLIC;

INSERT INTO fenceproxy.meta (key, value) VALUES ('version', '10')
	ON CONFLICT (key) DO UPDATE SET value = excluded.value;
