-- hold_at as objects versions 8 and 9 installed it: its reads of the
-- watermark compare lock names under the database's collation (version
-- 10 reads them by the index locks_name_c, byte by byte). The check
-- accepts it, as the same procedure; a test installs it.
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
