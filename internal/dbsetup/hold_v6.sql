-- hold as objects versions 6 to 9 installed it: its reads of the
-- watermark compare lock names under the database's collation (version
-- 10 reads them by the index locks_name_c, byte by byte). The check
-- accepts it, as the same procedure; a test installs it.
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
		SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name OPERATOR(pg_catalog.=) lk;
		IF w OPERATOR(pg_catalog.=) tok THEN
			-- Held shared, then read again: a newer holder may have
			-- registered while we waited (each read of a procedure that
			-- is not STABLE takes a new snapshot under READ COMMITTED).
			v := pg_catalog.pg_advisory_xact_lock_shared(1179667531, pg_catalog.hashtext(lk))::pg_catalog.text;
			SELECT l.token INTO w FROM fenceproxy.locks l WHERE l.name OPERATOR(pg_catalog.=) lk;
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
