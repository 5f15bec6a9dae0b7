-- rehold_at as objects version 9 installed it: its read of the watermark
-- compares lock names under the database's collation (version 10 reads
-- them by the index locks_name_c, byte by byte). The check accepts it,
-- as the same procedure; a test installs it.
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
		SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name OPERATOR(pg_catalog.=) lk;
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
