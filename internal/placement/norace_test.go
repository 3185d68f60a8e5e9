//go:build !race

package placement

const raceDetector = false
