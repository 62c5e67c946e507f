#include "fuzz_inputs.h"

namespace ember::fuzz {

std::string mutate(std::string s, std::mt19937_64& rng, const std::vector<std::string>& dictionary) {
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  const int rounds = 1 + static_cast<int>(rng() % 4);
  for (int round = 0; round < rounds; ++round) {
    switch (rng() % 7) {
      case 0:  // flip a bit
        if (!s.empty()) s[pick(s.size())] ^= static_cast<char>(1u << (rng() % 8));
        break;
      case 1:  // set a byte, often to a boundary value
        if (!s.empty()) {
          static constexpr unsigned char kBytes[] = {0, 1, 0x7F, 0x80, 0xFF, '\n', '"', '\'', '[', ']', '=', '.', '\\', '%'};
          s[pick(s.size())] = static_cast<char>(rng() % 2 ? kBytes[pick(sizeof kBytes)] : rng() % 256);
        }
        break;
      case 2:  // delete a run
        if (!s.empty()) {
          const size_t at = pick(s.size());
          s.erase(at, 1 + pick(std::min<size_t>(16, s.size() - at)));
        }
        break;
      case 3:  // duplicate a run
        if (!s.empty()) {
          const size_t at = pick(s.size());
          const std::string run = s.substr(at, 1 + pick(32));
          s.insert(pick(s.size() + 1), run);
        }
        break;
      case 4:  // insert random bytes
        for (size_t i = 0, n = 1 + pick(8), at = pick(s.size() + 1); i < n; ++i) s.insert(s.begin() + static_cast<long>(at), static_cast<char>(rng() % 256));
        break;
      default:  // insert or overwrite with a dictionary token
        if (!dictionary.empty()) {
          const std::string& token = dictionary[pick(dictionary.size())];
          const size_t at = pick(s.size() + 1);
          if (rng() % 2 || at + token.size() > s.size()) s.insert(at, token);
          else s.replace(at, token.size(), token);
        }
        break;
    }
  }
  return s;
}

}  // namespace ember::fuzz
