# SPDX-License-Identifier: Apache-2.0
# Run by `cmake --install` and by CPack (install(CODE) in CMakeLists.txt): writes tmsdiskd.service with
# the paths of the prefix being installed to, which may differ from the one configured
# (`cmake --install --prefix /usr`, the .deb), installs both units, and the configuration unless one is
# there already (an administrator's edits are never overwritten; dpkg treats it as a conffile).
# In: TMSDISK_SOURCE_DIR, TMSDISK_BINARY_DIR, TMSDISK_SBINDIR, TMSDISK_SYSCONFDIR (GNUInstallDirs, as
# configured) and TMSDISK_SYSTEMD_UNIT_DIR (absolute, or relative to the prefix).

# GNUInstallDirs' rule for CMAKE_INSTALL_FULL_<dir>, applied to the install-time prefix: the prefix
# "/" puts everything at the top; "/usr" and "/opt/<pkg>" keep configuration in /etc (FHS).
function(tmsdisk_full_dir out dir kind)
  set(prefix "${CMAKE_INSTALL_PREFIX}")
  if(IS_ABSOLUTE "${dir}")
    set(full "${dir}")
  elseif(prefix MATCHES "^/*$")
    set(full "/${dir}")
  elseif(kind STREQUAL "sysconf" AND prefix MATCHES "^/usr/*$")
    set(full "/${dir}")
  elseif(kind STREQUAL "sysconf" AND prefix MATCHES "^/opt/(.*)")
    set(full "/${dir}/opt/${CMAKE_MATCH_1}")
  else()
    string(REGEX REPLACE "/+$" "" prefix "${prefix}")
    set(full "${prefix}/${dir}")
  endif()
  set(${out} "${full}" PARENT_SCOPE)
endfunction()

tmsdisk_full_dir(TMSDISK_SBINDIR "${TMSDISK_SBINDIR}" plain)
tmsdisk_full_dir(sysconfdir "${TMSDISK_SYSCONFDIR}" sysconf)
tmsdisk_full_dir(unit_dir "${TMSDISK_SYSTEMD_UNIT_DIR}" plain)
set(TMSDISK_CONFIG_FILE "${sysconfdir}/tmsdisk/tmsdiskd.conf")
set(TMSDISK_GENERATED_NOTE "Generated for ${CMAKE_INSTALL_PREFIX} from systemd/tmsdiskd.service.in.")

set(generated "${TMSDISK_BINARY_DIR}/systemd/tmsdiskd.service")
configure_file("${TMSDISK_SOURCE_DIR}/systemd/tmsdiskd.service.in" "${generated}" @ONLY)
file(INSTALL DESTINATION "${unit_dir}" TYPE FILE FILES "${generated}" "${TMSDISK_SOURCE_DIR}/systemd/tmsdiskd.socket")

if(EXISTS "$ENV{DESTDIR}${TMSDISK_CONFIG_FILE}")
  message(STATUS "Keeping: $ENV{DESTDIR}${TMSDISK_CONFIG_FILE} (${TMSDISK_SOURCE_DIR}/systemd/tmsdiskd.conf.example is the default)")
else()
  file(INSTALL DESTINATION "${sysconfdir}/tmsdisk" TYPE FILE RENAME tmsdiskd.conf
       FILES "${TMSDISK_SOURCE_DIR}/systemd/tmsdiskd.conf.example")
endif()
