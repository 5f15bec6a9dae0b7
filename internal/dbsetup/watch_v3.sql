-- catalog_at(stamp) as setup installed it before it set lock_timeout
-- while another transaction's change of the catalog is under way. Kept
-- only for comparison: a watch with this check is still in place (the
-- proxy calls it), and setup replaces it (watch.go, readWatch).
CREATE OR REPLACE PROCEDURE fenceproxy.catalog_at(want bigint)
LANGUAGE plpgsql
AS $at$
DECLARE
	s bigint;
	b bigint;
	w bigint;
	x pg_catalog.xid;
	ref bigint;
	wide bigint;
	moved boolean := false;
BEGIN
	PERFORM FROM fenceproxy.catalog c
		WHERE c.stamp OPERATOR(pg_catalog.=) want AND c.xmax OPERATOR(pg_catalog.=) '0'::pg_catalog.xid
			AND (c.writer OPERATOR(pg_catalog.=) pg_catalog.txid_current_if_assigned()) IS NOT TRUE;
	IF FOUND THEN
		RETURN;
	END IF;
	SELECT c.stamp, c.base, c.writer, c.xmax INTO s, b, w, x FROM fenceproxy.catalog c;
	IF w OPERATOR(pg_catalog.=) pg_catalog.txid_current_if_assigned() THEN
		s := b;
	ELSIF x OPERATOR(pg_catalog.<>) '0'::pg_catalog.xid
			AND pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' THEN
		BEGIN
			ref := pg_catalog.txid_snapshot_xmax(pg_catalog.txid_current_snapshot());
			wide := (ref OPERATOR(pg_catalog.>>) 32 OPERATOR(pg_catalog.<<) 32)
				OPERATOR(pg_catalog.+) x::pg_catalog.text::bigint;
			IF wide OPERATOR(pg_catalog.>) (ref OPERATOR(pg_catalog.+) 2147483648) THEN
				wide := wide OPERATOR(pg_catalog.-) 4294967296;
			ELSIF wide OPERATOR(pg_catalog.<) (ref OPERATOR(pg_catalog.-) 2147483648) THEN
				wide := wide OPERATOR(pg_catalog.+) 4294967296;
			END IF;
			moved := (pg_catalog.txid_status(wide) OPERATOR(pg_catalog.=) 'committed') IS TRUE;
		EXCEPTION WHEN OTHERS THEN
			moved := true;
		END;
	END IF;
	IF (s OPERATOR(pg_catalog.=) want) IS NOT TRUE OR moved THEN
		RAISE EXCEPTION 'fenceproxy: the catalog of database % changed since the proxy checked it; the statement did not run', pg_catalog.current_database()
			USING ERRCODE = 'FP003',
				DETAIL = pg_catalog.format('The proxy decided it with the paths to protected tables of catalog stamp %s; the stamp is now %s.',
					want, coalesce(CASE WHEN moved THEN 'newer than this transaction''s snapshot' ELSE s::pg_catalog.text END, 'unknown')),
				HINT = 'Retry it: the proxy checks the database again before it decides the retry.';
	END IF;
END
$at$;
