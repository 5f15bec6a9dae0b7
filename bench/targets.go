package main

import (
	"fmt"
	"math"
)

// The tables' verdicts: a figure against its target, compared as printed
// (ratios to two decimals, µs to one), so that a verdict never contradicts
// the figures beside it.

// roundTo rounds v to the given number of decimals.
func roundTo(v float64, decimals int) float64 {
	p := math.Pow(10, float64(decimals))
	return math.Round(v*p) / p
}

// atLeast says whether v, printed with decimals, reaches min: "holds", or
// "misses by" the shortfall, with unit ("" for a ratio).
func atLeast(v, min float64, decimals int, unit string) string {
	return verdict(roundTo(min, decimals)-roundTo(v, decimals), decimals, unit)
}

// atMost says whether v, printed with decimals, stays within max.
func atMost(v, max float64, decimals int, unit string) string {
	return verdict(roundTo(v, decimals)-roundTo(max, decimals), decimals, unit)
}

// verdict words a shortfall (≤ 0: the target holds).
func verdict(short float64, decimals int, unit string) string {
	if roundTo(short, decimals) <= 0 {
		return "holds"
	}
	return fmt.Sprintf("misses by %.*f%s", decimals, short, unit)
}
